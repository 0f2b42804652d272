"""The SGLang engine: bad input is refused with errors that say what to do (these run everywhere), and,
on a CUDA machine with SGLang installed (``@pytest.mark.gpu``), behaviour log-probs equal the trainer's
recompute and greedy outputs follow full-weight and LoRA pushes, against the HF model on the same
weights. SGLang has no CPU build: on a CPU-only machine the gpu tests skip with that reason.

Self-contained (no imports from other test folders), so it runs unchanged wherever it is copied.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from unirl_lightning.engines.sglang import SGLangEngineConfig
from unirl_lightning.models.causal_lm import TinyCausalLM
from unirl_lightning.models.lora import LoraSpec
from unirl_lightning.rollout.records import RolloutRequest, SamplingParams

PROMPTS = ["1+2=", "3*4=", "7=", "12-5="]
# fp32 on the GPU: SGLang's kernels and the HF recompute may differ by TF32-level rounding
LOGPROB_TOL = 2e-3
# a greedy token may differ from HF's argmax only where the two best log-probs are this close (a tie)
TIE_TOL = 1e-3


def records() -> list[dict[str, str]]:
    return [{"prompt": p} for p in PROMPTS]


def tiny_policy(seed: int = 0) -> TinyCausalLM:
    """Head size 64: every SGLang attention backend takes it."""
    return TinyCausalLM(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256, seed=seed)


# -- bad input (no GPU, no SGLang needed) -------------------------------------------------------------
def test_module_imports_without_sglang():
    code = "import sys; sys.modules['sglang'] = None; import unirl_lightning.engines.sglang as m; print(m.SGLangEngineConfig())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_build_without_sglang_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # what `import sglang` sees where it is not installed
    with pytest.raises(ImportError, match=r"pip install 'unirl-lightning\[sglang\]'"):
        SGLangEngineConfig().build(tiny_policy())


def test_original_logprob_mode_is_refused(monkeypatch):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with pytest.raises(ValueError, match="temperature-1 log-probs"):
        SGLangEngineConfig().build(tiny_policy())


def test_bad_config_values_are_rejected():
    with pytest.raises(ValueError, match="mem_fraction_static must be in"):
        SGLangEngineConfig(mem_fraction_static=1.5)
    with pytest.raises(ValueError, match="bucket_mb must be > 0"):
        SGLangEngineConfig(bucket_mb=0)


# -- a real SGLang on a GPU -------------------------------------------------------------------------
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="SGLang needs a CUDA GPU (none here)")


def start(**overrides):
    pytest.importorskip("sglang", reason="SGLang is not installed: pip install 'unirl-lightning[sglang]'")
    lora = overrides.pop("lora", None)
    kwargs = dict(mem_fraction_static=0.2, engine_kwargs={"attention_backend": "triton"})
    kwargs.update(overrides)
    return SGLangEngineConfig(**kwargs).build(tiny_policy(), lora)


def hf_model(seed: int = 0):
    model, _ = tiny_policy(seed).build()
    return model.eval()


def completion_logprobs(model, rollout, temperature: float) -> torch.Tensor:
    """The trainer's recompute: ``log_softmax(logits / T)`` at the completion tokens, teacher-forced."""
    ids = torch.tensor([rollout.prompt_ids + rollout.completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(rollout.prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1)


def assert_greedy_follows(model, engine):
    """Each greedy token is the HF model's argmax (up to a tie within TIE_TOL), and the run is not empty."""
    groups = engine.generate(
        RolloutRequest(records(), n=1, sampling=SamplingParams(temperature=0, max_new_tokens=12))
    )
    for group in groups:
        rollout = group[0]
        logp = completion_logprobs(model, rollout, 1.0)
        chosen = logp.gather(-1, torch.tensor(rollout.completion_ids)[:, None]).squeeze(-1)
        gap = (logp.max(-1).values - chosen).max().item()
        assert gap <= TIE_TOL, (
            f"greedy token is not HF's argmax (log-prob gap {gap:.2e}) for {rollout.prompt!r}"
        )
    return [g[0].completion_ids for g in groups]


@pytest.fixture
def engine():
    """One SGLang engine per test, closed before the next starts (its process-wide state is not shared)."""
    engine = start()
    yield engine
    engine.close()


@gpu
@needs_cuda
def test_sampled_token_logprobs_equal_trainer_recompute(engine):
    model = hf_model()
    for temperature in (1.0, 0.7):
        request = RolloutRequest(
            records(), n=4, sampling=SamplingParams(temperature=temperature, max_new_tokens=12)
        )
        worst = 0.0
        for group in engine.generate(request):
            assert len(group) == 4
            for rollout in group:
                assert len(rollout.logprobs) == len(rollout.completion_ids) >= 1
                logp = completion_logprobs(model, rollout, temperature)
                expected = logp.gather(-1, torch.tensor(rollout.completion_ids)[:, None]).squeeze(-1)
                worst = max(worst, (expected - torch.tensor(rollout.logprobs)).abs().max().item())
        assert worst < LOGPROB_TOL, f"SGLang vs HF log-probs differ by {worst:.2e} at T={temperature}"


@gpu
@needs_cuda
def test_rollouts_keep_eos_and_report_finish_reasons(engine):
    eos = engine.tokenizer.eos_token_id
    groups = engine.generate(
        RolloutRequest(records(), n=8, sampling=SamplingParams(max_new_tokens=12), gen_id=3)
    )
    for group_id, group in enumerate(groups):
        for rollout in group:
            assert (rollout.group_id, rollout.gen_id, rollout.weight_version) == (group_id, 3, 0)
            assert eos not in rollout.completion_ids[:-1]
            if rollout.finish_reason == "stop":
                assert rollout.completion_ids[-1] == eos
            else:
                assert rollout.finish_reason == "length" and len(rollout.completion_ids) == 12


@gpu
@needs_cuda
def test_greedy_follows_a_full_weight_push_in_buckets():
    engine = start(bucket_mb=0.05)  # several buckets
    try:
        assert_greedy_follows(hf_model(0), engine)
        new = hf_model(5)
        engine.load_weights(((k, v) for k, v in new.state_dict().items()), weight_version=1)
        assert_greedy_follows(new, engine)
        sampled = engine.generate(RolloutRequest(records(), n=2, sampling=SamplingParams(max_new_tokens=8)))
        assert {r.weight_version for g in sampled for r in g} == {1}
    finally:
        engine.close()


@gpu
@needs_cuda
def test_greedy_follows_lora_adapter_pushes():
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    lora = LoraSpec(rank=8, alpha=16.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    engine = start(lora=lora)
    try:
        base = assert_greedy_follows(hf_model(0), engine)
        for version in (1, 2):  # the second push replaces the first adapter
            peft_model = get_peft_model(
                hf_model(0), LoraConfig(r=8, lora_alpha=16, target_modules=list(lora.target_modules))
            )
            generator = torch.Generator().manual_seed(version)
            with torch.no_grad():
                for name, param in peft_model.named_parameters():
                    if "lora_" in name:
                        param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
            engine.load_weights(get_peft_model_state_dict(peft_model).items(), weight_version=version)
            pushed = assert_greedy_follows(peft_model.merge_and_unload(), engine)
            assert pushed != base, "the adapter had no visible effect"
    finally:
        engine.close()


@gpu
@needs_cuda
def test_multi_turn_episodes_keep_behaviour_logprobs_on_every_model_token(engine):
    """The agentic coordinator drives guessing games over SGLang's token-level generate_ids: every
    model token's log-prob equals the trainer's recompute on the whole multi-turn context."""
    import time

    from unirl_lightning.envs import EpisodeCoordinator, EpisodeRequest, guessing_records, resolve_environment

    coordinator = EpisodeCoordinator(
        engine,
        resolve_environment("unirl_lightning.envs:GuessingGameEnv", {"max_turns": 4}),
        SamplingParams(temperature=1.0, max_new_tokens=2),
    )
    requests = [EpisodeRequest(f"g{i}/0", r, seed=i) for i, r in enumerate(guessing_records(16, seed=0))]
    coordinator.submit(requests)
    samples, deadline = [], time.monotonic() + 120
    while not coordinator.finalize_if_drained():
        samples += coordinator.poll()
        assert time.monotonic() < deadline, "the episodes did not finish"
        time.sleep(0.01)
    coordinator.close()
    assert len(samples) == 16 and max(s.num_turns for s in samples) > 1
    model = hf_model()
    worst = 0.0
    for sample in samples:
        logp = completion_logprobs(model, sample, 1.0)
        expected = logp.gather(-1, torch.tensor(sample.completion_ids)[:, None]).squeeze(-1)
        mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
        worst = max(worst, (expected - torch.tensor(sample.logprobs))[mask].abs().max().item())
    assert worst < LOGPROB_TOL, f"SGLang multi-turn log-probs differ from HF's by {worst:.2e}"
