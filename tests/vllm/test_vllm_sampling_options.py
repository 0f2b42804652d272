"""The sampling options reach a real (CPU) vLLM: top_k=1 samples the greedy completion, every option
lands in vLLM's SamplingParams, and a token budget beyond ``max_model_len`` is refused naming it."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm runs these in .venv-vllm)")

from tests.vllm.helpers import records, tiny_policy  # noqa: E402
from unirl_lightning.engines.vllm import VLLMEngineConfig  # noqa: E402
from unirl_lightning.rollout.records import RolloutRequest, SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    engine = VLLMEngineConfig(max_model_len=64, sampling_overrides={"presence_penalty": 0.0}).build(
        tiny_policy()
    )
    yield engine
    engine.close()


def completions(engine, sampling: SamplingParams, seed: int | None) -> list[list[int]]:
    groups = engine.generate(RolloutRequest(records(), n=2, sampling=sampling, seed=seed))
    return [r.completion_ids for g in groups for r in g]


def test_top_k_1_equals_greedy(engine):
    greedy = completions(engine, SamplingParams(temperature=0, max_new_tokens=8), None)
    top1 = completions(engine, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=8), 3)
    assert top1 == greedy


def test_every_option_reaches_vllm_sampling_params(engine):
    sampling = SamplingParams(
        temperature=0.9, top_p=0.8, top_k=4, min_p=0.1, repetition_penalty=1.2, stop=("=",)
    )
    params = engine._params(sampling, 1, 5)
    assert (params.top_k, params.top_p, params.min_p, params.repetition_penalty) == (4, 0.8, 0.1, 1.2)
    assert params.stop == ["="] and params.seed == 5 and params.presence_penalty == 0.0
    samples = engine.generate_ids([[3, 4, 5]], sampling, seed=1)
    assert len(samples) == 1 and len(samples[0][0]) == len(samples[0][1]) >= 1


def test_budget_beyond_max_model_len_is_refused_naming_it(engine):
    with pytest.raises(ValueError) as exc:
        engine.generate_ids([[3] * 10], SamplingParams(max_new_tokens=60))
    assert "max_new_tokens=60" in str(exc.value) and "max_model_len=64" in str(exc.value)
