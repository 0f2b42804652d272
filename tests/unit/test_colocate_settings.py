"""Colocated placement's settings: vLLM's sleep mode is on only under colocate, ``offload_optimizer``
needs colocate, vLLM wakes in parts, and the optimizer offload moves state away and back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.builders import rollout_settings
from unirl_lightning.engines.vllm import VLLMEngine, VLLMEngineConfig
from unirl_lightning.models.causal_lm import TinyCausalLM
from unirl_lightning.runtime.base import RolloutRuntime, optimizers_to_device, optimizers_to_host

COLOCATE = {"placement": "colocate", "max_staleness": 0, "max_inflight": 1}


def engine_config(engine, **overrides):
    spec = SimpleNamespace(family="token", policy=TinyCausalLM(), lora=None, reward=None)
    return RolloutRuntime(
        spec, rollout_settings(engine=engine, **overrides), weight_sync=None
    ).engine_config()


def test_vllm_sleep_mode_is_enabled_only_under_colocate_unless_set():
    assert VLLMEngineConfig().enable_sleep_mode is None  # "the runtime decides"
    assert engine_config(VLLMEngineConfig(), **COLOCATE).enable_sleep_mode is True
    assert engine_config(VLLMEngineConfig()).enable_sleep_mode is False
    assert engine_config(VLLMEngineConfig(enable_sleep_mode=False), **COLOCATE).enable_sleep_mode is False
    assert engine_config(VLLMEngineConfig(enable_sleep_mode=True)).enable_sleep_mode is True
    assert not hasattr(engine_config("hf", **COLOCATE), "enable_sleep_mode")  # configs without the field


def test_offload_optimizer_without_colocate_is_refused_naming_both_keys():
    with pytest.raises(
        ValueError, match=r"offload_optimizer=True .* needs placement='colocate', got placement='separate'"
    ):
        rollout_settings(offload_optimizer=True)
    assert rollout_settings(offload_optimizer=True, **COLOCATE).offload_optimizer


def test_vllm_wakes_the_weights_then_the_kv_cache():
    calls = []
    engine = object.__new__(VLLMEngine)
    engine.sleep_supported, engine._asleep = True, set()
    engine.config = SimpleNamespace(sleep_level=1)
    engine.llm = SimpleNamespace(
        sleep=lambda level: calls.append(("sleep", level)),
        wake_up=lambda tags: calls.append(("wake_up", tags)),
    )
    engine.sleep()
    engine.wake(["weights"])
    engine.wake(["weights"])  # already awake: nothing
    engine.wake(["kv_cache"])
    engine.wake()  # nothing left asleep
    engine.sleep()
    engine.wake()  # everything at once
    assert calls == [
        ("sleep", 1),
        ("wake_up", ["weights"]),
        ("wake_up", ["kv_cache"]),
        ("sleep", 1),
        ("wake_up", ["weights", "kv_cache"]),
    ]


def test_vllm_sleep_is_a_no_op_when_sleep_mode_is_off():
    engine = object.__new__(VLLMEngine)
    engine.sleep_supported, engine._asleep = False, set()
    engine.llm = None  # never touched
    engine.sleep()
    engine.wake(["weights"])
    assert engine._asleep == set()


def test_the_optimizer_offload_moves_only_device_state_and_back(monkeypatch):
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(3)
    optimizer.step()
    state = optimizer.state[param]
    before = {k: v.clone() for k, v in state.items()}
    assert optimizers_to_host([optimizer]) == []  # CPU training: the state is on the host already
    moved = [(state, "exp_avg", torch.device("cpu"))]  # as if it had been on a device
    optimizers_to_device(moved)
    assert all(torch.equal(state[k], v) for k, v in before.items())
