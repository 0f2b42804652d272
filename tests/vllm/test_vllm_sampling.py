"""The vLLM engine's samples against the trainer's recompute on the same tiny Llama, with a real (CPU)
vLLM: behaviour log-probs agree within 1e-4, rollouts have the HF engine's layout, seeded requests
repeat. One engine serves the module (in-process vLLM engines share global state: one live engine
per process, as in a rollout worker)."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm runs these in .venv-vllm)")

import torch  # noqa: E402

from tests.vllm.helpers import greedy_completions, max_logprob_gap, records, tiny_policy  # noqa: E402
from unirl_lightning.engines.hf import HFEngineConfig  # noqa: E402
from unirl_lightning.engines.vllm import VLLMEngineConfig  # noqa: E402
from unirl_lightning.rollout.records import RolloutRequest, SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    engine = VLLMEngineConfig().build(tiny_policy())
    yield engine
    engine.close()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_token_logprobs_equal_trainer_recompute_within_1e4(engine, temperature):
    request = RolloutRequest(
        records(), n=4, sampling=SamplingParams(temperature=temperature, max_new_tokens=12), seed=3
    )
    groups = engine.generate(request)
    assert [len(g) for g in groups] == [4] * len(records())
    model, _ = tiny_policy().build()
    gap = max_logprob_gap(model, groups, temperature)
    print(f"max |vLLM - HF| log-prob at T={temperature}: {gap:.2e}")
    assert gap < 1e-4


def test_greedy_equals_hf_engine_on_the_same_weights(engine):
    assert greedy_completions(engine) == greedy_completions(HFEngineConfig().build(tiny_policy()))


def test_rollouts_have_the_hf_engine_layout(engine):
    """prompt ids without padding/specials, eos kept when hit, one log-prob per token, stamps."""
    request = RolloutRequest(records(), n=8, sampling=SamplingParams(max_new_tokens=12), seed=0, gen_id=7)
    groups = engine.generate(request)
    tok = engine.tokenizer
    eos = tok.eos_token_id
    finishes = set()
    for group_id, (record, group) in enumerate(zip(records(), groups)):
        for rollout in group:
            assert rollout.prompt_ids == tok(record["prompt"], add_special_tokens=False)["input_ids"]
            assert rollout.prompt == record["prompt"]
            assert (rollout.group_id, rollout.gen_id, rollout.weight_version) == (group_id, 7, 0)
            assert len(rollout.logprobs) == len(rollout.completion_ids) >= 1
            assert all(lp <= 0 for lp in rollout.logprobs)
            assert eos not in rollout.completion_ids[:-1]
            if rollout.finish_reason == "stop":
                assert rollout.completion_ids[-1] == eos
            else:
                assert rollout.finish_reason == "length" and len(rollout.completion_ids) == 12
            assert rollout.text == tok.decode(rollout.completion_ids, skip_special_tokens=True)
            finishes.add(rollout.finish_reason)
    assert finishes == {"stop", "length"}, "expected both eos-terminated and length-capped samples"


def test_seeded_request_repeats_and_samples_differ_within_a_group(engine):
    request = RolloutRequest(records(), n=4, sampling=SamplingParams(max_new_tokens=8), seed=11)
    first = [[r.completion_ids for r in g] for g in engine.generate(request)]
    again = [[r.completion_ids for r in g] for g in engine.generate(request)]
    assert first == again
    assert all(len({tuple(c) for c in group}) > 1 for group in first), "a group's samples are all equal"


def test_adapter_push_to_a_full_weight_engine_names_the_fix(engine):
    adapter = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}
    with pytest.raises(ValueError, match="built without a LoraSpec"):
        engine.load_weights(adapter.items(), weight_version=1)
    mixed = {**adapter, "model.norm.weight": torch.ones(64)}
    with pytest.raises(ValueError, match="either full weights or LoRA adapter tensors"):
        engine.load_weights(mixed.items(), weight_version=1)
    assert engine.weight_version == 0


def test_sleep_and_wake_are_safe_on_cpu(engine):
    engine.sleep()
    engine.wake()
    engine.sleep()  # generate wakes a sleeping engine
    assert (
        len(engine.generate(RolloutRequest(records()[:1], n=1, sampling=SamplingParams(max_new_tokens=4))))
        == 1
    )
