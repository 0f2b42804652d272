"""``placement="hybrid"``'s rules, its weight sync and its worker group, without Ray: the settings it
refuses (naming the keys), the backend chosen with the group, the zero-copy and cast-copy pushes, and
the in-process group's interface (a ready handle, retryable errors, no replacement, the trainer's
random stream untouched)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.builders import rollout_settings
from unirl_lightning.core.preflight import resolve_weight_sync_name, weight_sync_placement_error
from unirl_lightning.engines.hf import HFEngineConfig
from unirl_lightning.models.causal_lm import TinyCausalLM
from unirl_lightning.rewards import ExactMatchReward
from unirl_lightning.rollout.records import RolloutRequest, SamplingParams
from unirl_lightning.weight_sync import InProcessWeightSync, ObjectStoreWeightSync, resolve_weight_sync
from unirl_lightning.weight_sync.base import set_serving_dtype
from unirl_lightning.workers.factory import worker_group_class
from unirl_lightning.workers.inprocess import InProcessWorkerGroup

HYBRID = {"placement": "hybrid", "max_staleness": 0, "max_inflight": 1}
RECORDS = [{"prompt": "12 d=", "answer": "3"}, {"prompt": "45 d=", "answer": "6"}]
POLICY = TinyCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


@pytest.mark.parametrize(("staleness", "inflight"), [(1, 1), (0, 2), (1, 2)])
def test_hybrid_is_synchronous_only_naming_both_keys(staleness, inflight):
    with pytest.raises(ValueError, match=r"placement='hybrid' .* in the training process .*max_staleness=0 and "
                       rf"max_inflight=1, got max_staleness={staleness}, max_inflight={inflight}"):  # fmt: skip
        rollout_settings(placement="hybrid", max_staleness=staleness, max_inflight=inflight)
    settings = rollout_settings(**HYBRID)
    assert settings.shares_trainer_device and settings.in_process and settings.synchronous


def test_hybrid_runs_one_engine_per_rank():
    with pytest.raises(ValueError, match=r"num_workers must be 1, got num_workers=2"):
        rollout_settings(num_workers=2, **HYBRID)


def test_placements_say_whether_they_share_the_trainer_device():
    assert not rollout_settings().shares_trainer_device
    colocate = rollout_settings(placement="colocate", max_staleness=0, max_inflight=1)
    assert colocate.shares_trainer_device and not colocate.in_process


def test_the_weight_sync_is_chosen_with_the_group_and_others_are_refused_naming_both_keys():
    assert resolve_weight_sync_name("hybrid", "auto") == "inprocess"
    assert resolve_weight_sync_name("colocate", "auto") == "object_store"
    assert isinstance(resolve_weight_sync("auto", "hybrid"), InProcessWeightSync)
    assert isinstance(resolve_weight_sync("auto", "separate"), ObjectStoreWeightSync)
    for name in ("object_store", "collective", "other"):
        error = weight_sync_placement_error("hybrid", name)
        assert "placement='hybrid'" in error and f"weight_sync={name!r}" in error and "'inprocess'" in error
    for placement in ("separate", "colocate"):
        error = weight_sync_placement_error(placement, "inprocess")
        assert "weight_sync='inprocess'" in error and f"placement={placement!r}" in error
        assert weight_sync_placement_error(placement, "collective") is None
    assert weight_sync_placement_error("hybrid", "inprocess") is None


def test_the_strategy_refuses_a_ray_backend_with_hybrid_at_construction():
    from unirl_lightning.strategy import AsyncRolloutStrategy

    with pytest.raises(ValueError, match=r"placement='hybrid' .* weight_sync='collective'"):
        AsyncRolloutStrategy(weight_sync="collective", **HYBRID)
    with pytest.raises(ValueError, match=r"weight_sync='inprocess' .* placement='separate'"):
        AsyncRolloutStrategy(weight_sync="inprocess")
    assert isinstance(AsyncRolloutStrategy(**HYBRID).weight_sync, InProcessWeightSync)


def test_the_group_class_is_keyed_on_placement():
    assert worker_group_class("hybrid") is InProcessWorkerGroup
    assert worker_group_class("separate").__name__ == "RolloutWorkerGroup"
    with pytest.raises(ValueError, match=r"placement must be one of \('separate', 'colocate', 'hybrid'\)"):
        worker_group_class("elsewhere")


def trainer_model(dtype: str = "float32") -> torch.nn.Module:
    model, _ = TinyCausalLM(
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, dtype=dtype
    ).build()
    model.float()  # the trainer's float32 masters
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # differ from the engine's own build
    if dtype != "float32":
        set_serving_dtype(model, getattr(torch, dtype))
    return model


def group(dtype: str = "float32", share_weights: bool = True, reward=None) -> InProcessWorkerGroup:
    policy = TinyCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, dtype=dtype)
    return InProcessWorkerGroup(
        HFEngineConfig(device="cpu", num_threads=None), policy, reward=reward, share_weights=share_weights
    )


def test_a_float32_push_is_shared_without_a_copy_and_the_engine_sees_the_trainers_tensors():
    model, workers = trainer_model(), group()
    stats = InProcessWeightSync().push(model, workers, 3)
    engine = workers.workers[0].engine
    assert stats.bytes == 0 and engine.weight_version == 3 and engine.shares_trainer_weights
    served = engine.model.state_dict()
    for name, tensor in model.state_dict().items():
        assert served[name].data_ptr() == tensor.data_ptr(), f"{name} was copied"


def test_a_bf16_engine_gets_a_cast_copy_and_without_sharing_a_float32_one_too():
    model, workers = trainer_model("bfloat16"), group("bfloat16")
    stats = InProcessWeightSync(bucket_mb=0.01).push(model, workers, 1)  # several buckets
    engine = workers.workers[0].engine
    assert stats.bytes == sum(t.numel() * 2 for t in model.state_dict().values())
    assert not engine.shares_trainer_weights
    for name, tensor in model.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], tensor.to(torch.bfloat16)), name
    model32, copying = trainer_model(), group(share_weights=False)
    stats = InProcessWeightSync(bucket_mb=0.01).push(model32, copying, 2)
    served = copying.workers[0].engine.model.state_dict()
    assert stats.bytes == sum(t.numel() * 4 for t in model32.state_dict().values())
    for name, tensor in model32.state_dict().items():
        assert torch.equal(served[name], tensor) and served[name].data_ptr() != tensor.data_ptr()


def test_generation_is_ready_at_once_scored_in_process_and_leaves_the_trainers_rng_alone():
    workers = group(reward=ExactMatchReward())
    request = RolloutRequest(RECORDS, n=3, sampling=SamplingParams(max_new_tokens=2), seed=5, gen_id=0)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    handle = workers.generate(request)
    assert torch.equal(torch.rand(3), expected), "generation moved the trainer's random stream"
    assert handle.ready()
    result = handle.result()
    assert [len(g) for g in result.groups] == [3, 3]
    assert all(r.reward in (0.0, 1.0) for g in result.groups for r in g)
    assert result.spans[0]["samples"] == 6 and result.generate_s > 0
    again = workers.generate(request).result().groups  # same seed, same samples
    assert [r.completion_ids for g in again for r in g] == [
        r.completion_ids for g in result.groups for r in g
    ]
    assert workers.call("weight_version") == [0]
    assert workers.call("placement_info")[0]["in_process"] is True


def failing_reward(completions, **_):
    raise ValueError("the reward broke")


def test_a_failing_generation_raises_from_result_every_time_and_nothing_is_replaced():
    from unirl_lightning.rewards import CallableReward

    workers = group(reward=CallableReward(failing_reward))
    request = RolloutRequest(RECORDS, n=2, sampling=SamplingParams(max_new_tokens=2), seed=0, gen_id=0)
    handle = workers.generate(request)
    assert handle.ready()
    for _ in range(2):
        with pytest.raises(Exception, match="the reward broke"):
            handle.result()
    assert workers.max_restarts == 0 and workers.restarts == 0
    with pytest.raises(RuntimeError, match=r"placement='hybrid' cannot replace it"):
        workers.replace(0, workers.workers[0], "died")
    workers.shutdown()
    workers.shutdown()  # twice is fine
    with pytest.raises(RuntimeError, match="shut down"):
        workers.generate(request)


# -- vLLM under hybrid: its engine core in the training process, on one rank --------------------------
def hybrid_engine_config(engine, **overrides):
    from types import SimpleNamespace

    from unirl_lightning.runtime.base import RolloutRuntime

    spec = SimpleNamespace(family="token", policy=POLICY, lora=None, reward=None)
    settings = rollout_settings(engine=engine, **{**HYBRID, **overrides})
    return RolloutRuntime(spec, settings, weight_sync=None).engine_config()


def test_hybrid_runs_vllms_engine_core_in_process_with_sleep_mode_and_refuses_a_process_of_its_own():
    from unirl_lightning.engines.vllm import VLLMEngineConfig

    assert VLLMEngineConfig().in_process_core is None  # "the strategy decides"
    served = hybrid_engine_config(VLLMEngineConfig())
    assert served.in_process_core is True and served.enable_sleep_mode is True  # sleep: CUDA only
    separate = hybrid_engine_config(VLLMEngineConfig(), placement="separate", max_staleness=1, max_inflight=2)
    assert separate.in_process_core is None and separate.enable_sleep_mode is False
    with pytest.raises(
        ValueError, match=r"placement='hybrid' .* engine.in_process_core=False .* process of its own"
    ):
        hybrid_engine_config(VLLMEngineConfig(in_process_core=False))
    with pytest.raises(
        ValueError, match=r"placement='hybrid' .*engine.batching='continuous' runs vLLM's AsyncLLM"
    ):
        hybrid_engine_config(VLLMEngineConfig(batching="continuous"))
    assert not hasattr(hybrid_engine_config("hf"), "in_process_core")


def test_vllm_in_process_sets_the_multiprocessing_variable_and_refuses_another_value(monkeypatch):
    from unirl_lightning.engines.vllm import VLLMEngineConfig, keep_engine_core_in_process

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    keep_engine_core_in_process()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    policy = TinyCausalLM(hidden_size=64, num_layers=1, num_heads=2, intermediate_size=64)
    with pytest.raises(
        ValueError, match=r"engine.in_process_core=True .* VLLM_ENABLE_V1_MULTIPROCESSING='1'"
    ):
        VLLMEngineConfig(in_process_core=True).build(policy)  # refused before vLLM is imported


def test_vllm_under_hybrid_is_refused_on_several_ranks_naming_placement_and_engine():
    from unirl_lightning.core.preflight import hybrid_engine_error
    from unirl_lightning.engines import engine_name
    from unirl_lightning.engines.vllm import VLLMEngineConfig
    from unirl_lightning.planning.plan import parse_cluster, plan_recipe
    from unirl_lightning.strategy import AsyncRolloutStrategy

    class MyVLLM(VLLMEngineConfig):
        pass

    assert [engine_name(e) for e in ("vllm", VLLMEngineConfig(), MyVLLM(), HFEngineConfig())] == [
        "vllm", "vllm", "vllm", "hf"
    ]  # fmt: skip
    error = hybrid_engine_error("hybrid", "vllm", 2)
    assert "placement='hybrid' with engine='vllm'" in error and "got 2 training ranks" in error
    assert "engine='hf'" in error and "placement='colocate'" in error
    assert hybrid_engine_error("hybrid", "unirl_lightning.engines.vllm.VLLMEngineConfig", 4) is not None
    assert hybrid_engine_error("hybrid", "vllm", 1) is None and hybrid_engine_error("hybrid", "hf", 2) is None
    assert hybrid_engine_error("colocate", "vllm", 2) is None
    sglang = hybrid_engine_error("hybrid", "unirl_lightning.engines.sglang.SGLangEngineConfig", 2)
    assert "placement='hybrid' with engine='sglang'" in sglang and "kills every child process" in sglang
    assert hybrid_engine_error("hybrid", "sglang", 1) is None
    for engine in ("vllm", VLLMEngineConfig()):
        with pytest.raises(
            ValueError, match=r"placement='hybrid' with engine='vllm' .* got 2 training ranks"
        ):
            AsyncRolloutStrategy(engine=engine, **HYBRID).preflight(2)
        AsyncRolloutStrategy(engine=engine, **HYBRID).preflight(1)
    AsyncRolloutStrategy(engine="hf", **HYBRID).preflight(2)
    rollout = {"engine": {"class_path": "unirl_lightning.engines.vllm.VLLMEngineConfig"}, **HYBRID}
    config = {"trainer": {"devices": 2, "strategy": {"init_args": rollout}}}
    findings = plan_recipe(config, parse_cluster("cpu"), None)["findings"]
    assert [f["key"] for f in findings if f["level"] == "error"] == ["trainer.strategy.init_args.engine"]
