"""Pins the engine choice (unirl_lightning.engines.base): names, "auto" per policy family, family
mismatches, and the shared glue every token engine builds its rollouts with."""

from __future__ import annotations

import pytest

from unirl_lightning.engines import resolve_engine
from unirl_lightning.engines.base import make_group, trim_at_stop
from unirl_lightning.engines.diffusion import DiffusionEngineConfig
from unirl_lightning.engines.hf import HFEngineConfig
from unirl_lightning.models.causal_lm import build_char_tokenizer
from unirl_lightning.rollout.records import RolloutRequest
from unirl_lightning.strategy import AsyncRolloutStrategy


def test_auto_serves_each_family_with_its_default_engine():
    assert type(resolve_engine("auto", "hf", "token")) is HFEngineConfig
    assert type(resolve_engine("auto", "diffusion", "diffusion")) is DiffusionEngineConfig
    config = HFEngineConfig(num_threads=2)
    assert resolve_engine(config, "hf", "token") is config


def test_unknown_engine_name_is_refused_at_construction_listing_the_engines_and_the_extras():
    with pytest.raises(
        ValueError,
        match=r"engine must be one of \('auto', 'hf', 'vllm', 'sglang', 'diffusion'\).*got 'tgi'.*\[vllm\]",
    ):
        AsyncRolloutStrategy(engine="tgi")


def test_an_engine_of_the_wrong_family_is_refused_naming_auto():
    with pytest.raises(
        ValueError,
        match=r"DiffusionEngineConfig serves diffusion policies, but the module trains a token policy",
    ):
        resolve_engine(DiffusionEngineConfig(), "hf", "token")
    with pytest.raises(ValueError, match=r"serves token policies.*diffusion policy: use engine='auto'"):
        resolve_engine("hf", "diffusion", "diffusion")


def test_rows_are_cut_after_the_first_stop_token_which_is_kept():
    assert trim_at_stop([5, 6, 2, 0, 0], [2]) == ([5, 6, 2], "stop")
    assert trim_at_stop([5, 6, 7], [2, 9]) == ([5, 6, 7], "length")


def test_make_group_stamps_every_rollout_with_the_request_and_decodes_without_special_tokens():
    tok = build_char_tokenizer()
    request = RolloutRequest(records=[{"prompt": "1="}, {"prompt": "2="}], n=2, gen_id=7)
    eos = tok.eos_token_id
    samples = [
        (tok.encode("3", add_special_tokens=False) + [eos], [-0.1, -0.2], "stop"),
        ([5], [-0.3], "length"),
    ]
    group = make_group(request, 1, [4, 5], samples, tok, weight_version=3)
    assert [(r.text, r.finish_reason, r.group_id, r.gen_id, r.weight_version, r.prompt) for r in group] == [
        ("3", "stop", 1, 7, 3, "2="),
        (tok.decode([5]), "length", 1, 7, 3, "2="),
    ]
