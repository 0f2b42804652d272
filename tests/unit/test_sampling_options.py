"""Sampling options (top_k, min_p, repetition_penalty, stop strings) reach every engine's sampling
call, bad values fail naming the key, and a token budget beyond the model's positions is refused."""

from __future__ import annotations

import pytest

from unirl_lightning.engines.base import check_context
from unirl_lightning.engines.hf import HFEngineConfig, generate_kwargs
from unirl_lightning.engines.sglang import SGLangEngineConfig, sglang_sampling_params
from unirl_lightning.engines.vllm import VLLMEngineConfig, vllm_sampling_kwargs
from unirl_lightning.models.causal_lm import TinyCausalLM
from unirl_lightning.modules import GRPOModule
from unirl_lightning.rollout.records import SamplingParams

POLICY = TinyCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
OPTIONS = SamplingParams(
    temperature=0.8, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.3, max_new_tokens=7, stop=("x",)
)


def test_defaults_are_off():
    s = SamplingParams()
    assert (s.top_k, s.min_p, s.repetition_penalty, s.stop) == (0, 0.0, 1.0, ())
    assert s.reshapes == []
    assert OPTIONS.reshapes == ["top_p", "top_k", "min_p", "repetition_penalty"]
    assert SamplingParams(temperature=0, top_k=3).reshapes == []  # greedy: nothing is truncated


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [3]}, "stop"),
    ],
)
def test_bad_values_fail_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ],
)
def test_module_refuses_bad_values_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        GRPOModule(policy=POLICY, num_generations=2, **kwargs)


def test_module_builds_its_sampling_from_the_options():
    module = GRPOModule(
        policy=POLICY, num_generations=2, top_k=4, min_p=0.1, repetition_penalty=1.2, stop=["\n"]
    )
    s = module.rollout_spec().sampling
    assert (s.top_k, s.min_p, s.repetition_penalty, s.stop) == (4, 0.1, 1.2, ("\n",))
    assert module.eval_sampling(0.0).stop == ("\n",)


def test_hf_generate_kwargs_carry_every_option():
    kwargs = generate_kwargs(OPTIONS)
    assert kwargs == dict(
        max_new_tokens=7,
        do_sample=True,
        temperature=0.8,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        repetition_penalty=1.3,
    )
    greedy = generate_kwargs(SamplingParams(temperature=0, top_k=5, repetition_penalty=1.3))
    assert greedy == dict(max_new_tokens=16, do_sample=False, repetition_penalty=1.3)
    assert generate_kwargs(SamplingParams())["top_k"] == 0  # off, not the generation config's 50


def test_hf_engine_passes_the_options_and_stop_strings_to_generate(monkeypatch):
    engine = HFEngineConfig(device="cpu", num_threads=1).build(POLICY)
    seen = {}

    class Called(Exception):
        pass

    def spy(**kwargs):
        seen.update(kwargs)
        raise Called

    monkeypatch.setattr(engine.model, "generate", spy)
    with pytest.raises(Called):
        engine.generate_ids([[3, 4, 5]], OPTIONS, seed=0)
    for key, value in generate_kwargs(OPTIONS).items():
        assert seen[key] == value
    assert seen["stop_strings"] == ["x"] and seen["tokenizer"] is engine.tokenizer


def test_hf_engine_samples_with_every_option():
    engine = HFEngineConfig(device="cpu", num_threads=1).build(POLICY)
    sampling = SamplingParams(temperature=0.8, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.3)
    samples = engine.generate_ids([[3, 4, 5], [6, 7]], sampling, seed=0)
    assert all(len(c) == len(lps) >= 1 for c, lps, _ in samples)


def test_hf_top_k_1_equals_greedy():
    engine = HFEngineConfig(device="cpu", num_threads=1).build(POLICY)
    prompts = [[3, 4, 5], [6, 7]]
    greedy = engine.generate_ids(prompts, SamplingParams(temperature=0, max_new_tokens=6))
    top1 = engine.generate_ids(prompts, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=6), seed=5)
    assert [c for c, _, _ in greedy] == [c for c, _, _ in top1]
    # log-probs stay those of the untruncated distribution at T=1 (not 0 = log 1 of the kept token)
    assert all(lp < 0 for _, lps, _ in top1 for lp in lps)


def test_hf_engine_refuses_a_budget_beyond_the_positions():
    engine = HFEngineConfig(device="cpu", num_threads=1).build(POLICY)  # 64 positions
    with pytest.raises(ValueError) as exc:
        engine.generate_ids([[3, 4, 5], [3] * 10], SamplingParams(max_new_tokens=60))
    message = str(exc.value)
    assert "max_new_tokens=60" in message and "10 tokens" in message
    assert "max_position_embeddings=64" in message
    engine.generate_ids([[3] * 10], SamplingParams(max_new_tokens=54))  # exactly fits


def test_module_refuses_max_new_tokens_beyond_the_positions():
    with pytest.raises(ValueError) as exc:
        GRPOModule(policy=POLICY, num_generations=2, max_new_tokens=200)
    assert "max_new_tokens=200" in str(exc.value) and "max_position_embeddings=64" in str(exc.value)


def test_check_context_names_the_numbers():
    check_context(10, 54, 64, "max_model_len")
    check_context(10, 10**6, None, "max_model_len")
    with pytest.raises(ValueError, match=r"max_new_tokens=55 .*10 tokens.*max_model_len=64"):
        check_context(10, 55, 64, "max_model_len")


def test_vllm_sampling_kwargs_carry_every_option():
    kwargs = vllm_sampling_kwargs(OPTIONS, [2], seed=11, overrides={"presence_penalty": 0.5})
    assert kwargs == dict(
        n=1,
        temperature=0.8,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        repetition_penalty=1.3,
        max_tokens=7,
        stop=["x"],
        stop_token_ids=[2],
        logprobs=0,
        seed=11,
        detokenize=True,
        presence_penalty=0.5,
    )
    greedy = vllm_sampling_kwargs(SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.2), [2], None)
    assert (greedy["top_k"], greedy["top_p"], greedy["min_p"]) == (0, 1.0, 0.0)


def test_sglang_sampling_params_carry_every_option():
    param = sglang_sampling_params(OPTIONS, [2], seed=None, overrides={"frequency_penalty": 0.1})
    assert param == {
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.05,
        "repetition_penalty": 1.3,
        "max_new_tokens": 7,
        "skip_special_tokens": True,
        "stop_token_ids": [2],
        "stop": ["x"],
        "frequency_penalty": 0.1,
    }
    assert sglang_sampling_params(SamplingParams(), [2], seed=4)["top_k"] == -1  # SGLang's off
    assert sglang_sampling_params(SamplingParams(), [2], seed=4)["sampling_seed"] == 4


@pytest.mark.parametrize("config", [VLLMEngineConfig, SGLangEngineConfig])
def test_sampling_overrides_refuse_what_the_engine_owns(config):
    assert config(sampling_overrides={"presence_penalty": 0.2}).sampling_overrides == {
        "presence_penalty": 0.2
    }
    with pytest.raises(ValueError, match=r"sampling_overrides must not set \['temperature', 'top_k'\]"):
        config(sampling_overrides={"top_k": 3, "temperature": 1.0})


def test_vllm_sampling_params_accept_the_kwargs():
    vllm = pytest.importorskip("vllm")
    params = vllm.SamplingParams(**vllm_sampling_kwargs(OPTIONS, [2], seed=1))
    assert (params.top_k, params.min_p, params.repetition_penalty, params.stop) == (5, 0.05, 1.3, ["x"])
