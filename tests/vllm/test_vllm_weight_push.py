"""Weight pushes into a real (CPU) vLLM: greedy outputs equal HF's on the pushed weights after a
full-weight push (in buckets) and after LoRA adapter pushes. Each test starts and closes its own
engine, one at a time (in-process vLLM engines share global state)."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm runs these in .venv-vllm)")

import torch  # noqa: E402

from tests.vllm.helpers import greedy_completions, max_logprob_gap, records, tiny_policy  # noqa: E402
from unirl_lightning.engines.hf import HFEngineConfig  # noqa: E402
from unirl_lightning.engines.vllm import VLLMEngineConfig  # noqa: E402
from unirl_lightning.models.lora import LoraSpec  # noqa: E402
from unirl_lightning.rollout.records import RolloutRequest, SamplingParams  # noqa: E402
from unirl_lightning.weight_sync import named_weights  # noqa: E402


def test_greedy_matches_hf_after_full_weight_push_in_buckets():
    engine = VLLMEngineConfig(bucket_mb=0.01).build(tiny_policy())  # ~one layer per bucket
    try:
        before = greedy_completions(engine)
        new_model, _ = tiny_policy(seed=5).build()
        engine.load_weights(named_weights(new_model).items(), weight_version=1)
        after = greedy_completions(engine)
        assert after == greedy_completions(HFEngineConfig().build(tiny_policy(seed=5)))
        assert after != before, "the push had no visible effect"
        sampled = engine.generate(
            RolloutRequest(records(), n=2, sampling=SamplingParams(max_new_tokens=8), seed=1)
        )
        assert {r.weight_version for g in sampled for r in g} == {1}
        assert max_logprob_gap(new_model, sampled, 1.0) < 1e-4, "log-probs must follow the pushed weights"
    finally:
        engine.close()


def lora_policy(lora: LoraSpec, scale: float, seed: int):
    """The tiny policy wrapped in peft LoRA with non-zero adapters (a fresh adapter has B = 0)."""
    from peft import LoraConfig, get_peft_model

    model, _ = tiny_policy().build()
    config = LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules), lora_dropout=0.0
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    return peft_model


def test_greedy_matches_hf_after_lora_adapter_push():
    lora = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"))
    engine = VLLMEngineConfig().build(tiny_policy(), lora)
    hf = HFEngineConfig().build(tiny_policy())
    try:
        base = greedy_completions(engine)
        assert base == greedy_completions(hf)
        for version, seed in ((1, 0), (2, 1)):  # the second push replaces the first adapter
            peft_model = lora_policy(lora, scale=0.3, seed=seed)
            adapter = named_weights(peft_model)
            assert adapter and all(".lora_" in name for name in adapter), "expected an adapter-only push"
            engine.load_weights(adapter.items(), weight_version=version)
            hf.model.load_state_dict(peft_model.merge_and_unload().state_dict())
            pushed = greedy_completions(engine)
            assert pushed == greedy_completions(hf), f"after LoRA push {version}"
            assert pushed != base, "the adapter had no visible effect"
        assert len(engine.llm.llm_engine.list_loras()) == 1, "old adapters must be removed"
    finally:
        engine.close()


def test_lora_push_with_another_rank_is_rejected():
    lora = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj",))
    engine = VLLMEngineConfig().build(tiny_policy(), lora)
    try:
        other = lora_policy(LoraSpec(rank=8, alpha=8.0, target_modules=("q_proj",)), scale=0.1, seed=0)
        with pytest.raises(ValueError, match=r"rank \[8\].*lora.rank=4"):
            engine.load_weights(named_weights(other).items(), weight_version=1)
        assert engine.weight_version == 0
    finally:
        engine.close()


@pytest.mark.slow
def test_full_push_reaches_a_multiprocess_engine_core(monkeypatch):
    """vLLM's default (and the GPU setup): the engine core in its own process; buckets travel packed."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    engine = VLLMEngineConfig(bucket_mb=0.01).build(tiny_policy())
    try:
        assert type(engine.llm.llm_engine.engine_core).__name__ != "InprocClient"
        new_model, _ = tiny_policy(seed=5).build()
        engine.load_weights(named_weights(new_model).items(), weight_version=1)
        assert greedy_completions(engine) == greedy_completions(HFEngineConfig().build(tiny_policy(seed=5)))
    finally:
        engine.close()


def test_pushes_are_vllms_own_update_sessions_and_a_failed_bucket_puts_every_layer_back():
    """Pushes run as vLLM's weight-transfer sessions on the engine's "unirl" backend: vLLM's worker
    refuses a chunk outside a session (its own guard), and a bucket that fails mid-push raises, ends
    the session and finalizes the layerwise reload (every layer back), so the engine still generates
    and the next push lands whole (greedy equal to HF on the pushed weights)."""
    engine = VLLMEngineConfig(bucket_mb=0.01).build(tiny_policy())  # ~one layer per bucket
    try:
        assert engine.llm.llm_engine.vllm_config.weight_transfer_config.backend == "unirl"
        with pytest.raises(Exception, match="start_weight_update must be called before update_weights"):
            engine.llm.collective_rpc("update_weights", kwargs={"update_info": {"bucket": []}})
        new_model, _ = tiny_policy(seed=5).build()
        items = list(named_weights(new_model).items())
        name, tensor = items[-1]
        broken = items[:-1] + [
            (name, torch.zeros(tensor.shape[0] + 3, *tensor.shape[1:]))
        ]  # a wrong shape, last
        with pytest.raises(Exception):  # noqa: B017 - vLLM's loader raises its own assertion
            engine.load_weights(broken, weight_version=1)
        assert engine.weight_version == 0
        assert greedy_completions(engine)  # still serving: no layer left unloaded
        engine.load_weights(items, weight_version=2)
        assert greedy_completions(engine) == greedy_completions(HFEngineConfig().build(tiny_policy(seed=5)))
    finally:
        engine.close()
