"""SGLang's setup rules, each a failure its first CUDA run would meet, pinned without SGLang (it has no
CPU build; the engine is written against SGLang 0.5.23's source and has not run on a GPU): a Ray worker
without a GPU refused before SGLang starts, the memory saver on where the engine shares the trainer's
GPU, float32 served with an attention backend that takes it, the scheduler on the process's device, the
NCCL cuMem setting both ends of a collective push agree on, the scheduler's real request cap, a sleep
refused while requests run, and every request's prefix-cache namespace named by its weight version."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from tests.builders import rollout_settings
from tests.unit.test_sglang_continuous import engine, request  # noqa: F401 (the stand-in fixture)
from unirl_lightning.core.device_rules import nccl_cumem_setting
from unirl_lightning.engines.serving import ServedPolicy
from unirl_lightning.engines.sglang import SGLangEngineConfig, sglang_engine_kwargs
from unirl_lightning.engines.sglang_async import running_request_slots
from unirl_lightning.strategy import AsyncRolloutStrategy
from unirl_lightning.weight_sync import CollectiveWeightSync
from unirl_lightning.workers.cluster import worker_runtime_env

FLOAT32 = ServedPolicy("/models/p", "float32", False, None)
BF16 = ServedPolicy("/models/p", "bfloat16", False, None)


def test_a_ray_worker_without_a_gpu_or_with_fewer_than_tp_size_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"engine='sglang' runs on CUDA GPUs .* num_gpus_per_worker=0 gives"):
        SGLangEngineConfig().for_placement(rollout_settings(num_gpus_per_worker=0))
    with pytest.raises(ValueError, match=r"num_gpus_per_worker=1 gives each worker 1: set .* tp_size \(2\)"):
        SGLangEngineConfig(tp_size=2).for_placement(rollout_settings(num_gpus_per_worker=1))
    with pytest.raises(
        ValueError, match=r"num_gpus_per_worker=2, worker_layout='per_gpu' gives each worker 0"
    ):
        SGLangEngineConfig().for_placement(rollout_settings(num_gpus_per_worker=2, worker_layout="per_gpu"))
    assert SGLangEngineConfig(tp_size=2).for_placement(rollout_settings(num_gpus_per_worker=2)).tp_size == 2


def test_fit_and_plan_refuse_sglang_without_gpus_naming_the_key(tmp_path, capsys, monkeypatch):
    from tests.unit.test_gpu_rules import EXAMPLES, fit_exit, plan_errors

    sglang = ["--config", str(EXAMPLES / "grpo_tiny.yaml"), "--trainer.strategy.init_args.engine=sglang"]
    errors = plan_errors(sglang, tmp_path)
    assert [e["key"] for e in errors] == ["trainer.strategy.init_args.num_gpus_per_worker"]
    assert "num_gpus_per_worker=0 gives each worker 0" in errors[0]["message"]
    assert plan_errors([*sglang, "--trainer.strategy.init_args.num_gpus_per_worker=1"], tmp_path) == []
    monkeypatch.chdir(tmp_path)
    code, last = fit_exit(sglang, capsys)
    assert code == 2 and last.startswith("error: trainer.strategy.init_args.num_gpus_per_worker"), last


@pytest.mark.parametrize(
    ("placement", "asked", "expected"),
    [
        ("separate", None, False),
        ("colocate", None, True),
        ("colocate", False, False),
        ("separate", True, True),
    ],
)
def test_the_memory_saver_is_on_by_default_only_where_the_engine_shares_the_trainers_gpu(
    placement, asked, expected
):
    settings = rollout_settings(placement=placement, num_gpus_per_worker=1, max_staleness=0, max_inflight=1)
    config = SGLangEngineConfig(enable_memory_saver=asked).for_placement(settings)
    assert config.enable_memory_saver is expected
    kwargs = sglang_engine_kwargs(config, BF16, None)
    assert kwargs.get("enable_memory_saver", False) is expected
    assert kwargs.get("enable_weights_cpu_backup", False) is expected  # woken without a push: weights kept


def test_float32_gets_an_attention_backend_that_takes_it_and_the_scheduler_the_processs_device(monkeypatch):
    assert sglang_engine_kwargs(SGLangEngineConfig(), FLOAT32, None)["attention_backend"] == "triton"
    assert "attention_backend" not in sglang_engine_kwargs(
        SGLangEngineConfig(), BF16, None
    )  # SGLang's choice
    own = SGLangEngineConfig(engine_kwargs={"attention_backend": "torch_native", "base_gpu_id": 1})
    assert sglang_engine_kwargs(own, FLOAT32, None)["attention_backend"] == "torch_native"
    assert "base_gpu_id" not in sglang_engine_kwargs(SGLangEngineConfig(), BF16, None)  # no CUDA here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # a hybrid rank's device
    assert sglang_engine_kwargs(SGLangEngineConfig(), BF16, None)["base_gpu_id"] == 3
    assert sglang_engine_kwargs(own, BF16, None)["base_gpu_id"] == 1


def test_building_without_cuda_fails_before_sglang_starts_naming_the_remedy(monkeypatch):
    package = types.ModuleType("sglang")
    package.Engine = lambda **kwargs: pytest.fail("SGLang was started without a GPU")
    monkeypatch.setitem(sys.modules, "sglang", package)
    with pytest.raises(RuntimeError, match=r"engine='sglang' needs a CUDA GPU .*\(num_gpus_per_worker\)"):
        SGLangEngineConfig().build(None)


def test_a_collective_push_into_sglang_has_the_trainer_take_sglangs_nccl_cumem_setting(monkeypatch):
    assert nccl_cumem_setting("sglang", "collective", "auto", None) == "0"
    assert nccl_cumem_setting("sglang", "collective", "nccl", None) == "0"
    assert nccl_cumem_setting("sglang", "collective", "nccl", "1") is None  # the user's own value stands
    assert nccl_cumem_setting("sglang", "collective", "gloo", None) is None
    assert nccl_cumem_setting("sglang", "object_store", "auto", None) is None
    assert nccl_cumem_setting("vllm", "collective", "nccl", None) is None  # vLLM 0.33 leaves NCCL's default
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    AsyncRolloutStrategy(engine="hf", weight_sync="collective")
    assert "NCCL_CUMEM_ENABLE" not in os.environ
    assert "NCCL_CUMEM_ENABLE" not in worker_runtime_env()["env_vars"]
    AsyncRolloutStrategy(engine="sglang", weight_sync=CollectiveWeightSync(backend="auto"))
    assert os.environ["NCCL_CUMEM_ENABLE"] == "0"
    assert worker_runtime_env()["env_vars"]["NCCL_CUMEM_ENABLE"] == "0"  # the workers' NCCL agrees


def test_the_request_cap_is_the_one_sglangs_scheduler_sized():
    class Info:
        def __init__(self, info):
            self.info = info

        def get_server_info(self):
            return self.info

    sized = {"max_running_requests": None, "internal_states": [{"effective_max_running_requests_per_dp": 48}]}
    assert running_request_slots(Info(sized), 64) == 48
    assert running_request_slots(Info({"max_running_requests": 12}), 64) == 12  # a launch argument
    assert running_request_slots(Info({"max_running_requests": None, "internal_states": []}), 64) == 64


def test_a_sleep_while_requests_run_is_refused_instead_of_killing_sglangs_scheduler(engine):  # noqa: F811
    engine.config.enable_memory_saver = True
    engine.rows.add(+1)
    try:
        with pytest.raises(RuntimeError, match=r"cannot sleep with 1 request\(s\) running"):
            engine.sleep()
    finally:
        engine.rows.add(-1)
    engine.engine.release_memory_occupation = lambda: engine.engine.tokenizer_manager.calls.append("release")
    engine.sleep()
    assert engine.engine.tokenizer_manager.calls[-1] == "release"
