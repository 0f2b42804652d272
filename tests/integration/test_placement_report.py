"""The placement wiring of the rollout runtime: the settings reach the worker group, vLLM's
tensor_parallel_size follows num_gpus_per_worker, every run writes ``placement.json`` into its log
folder, and a worker on a training rank's GPU fails setup under ``placement="separate"``."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import ray
import torch

import unirl_lightning.workers.factory as factory
from tests.builders import fit_tiny, rollout_settings
from unirl_lightning.engines.vllm import VLLMEngineConfig
from unirl_lightning.models.causal_lm import TinyCausalLM
from unirl_lightning.runtime.base import RolloutRuntime
from unirl_lightning.strategy import AsyncRolloutStrategy


def settings(**overrides):
    return rollout_settings(**{"engine": "hf", "num_workers": 2, **overrides})


def runtime(**overrides) -> RolloutRuntime:
    spec = SimpleNamespace(family="token", policy=TinyCausalLM(), lora=None, reward=None)
    return RolloutRuntime(spec, settings(**overrides), weight_sync=SimpleNamespace(push=lambda *a: None))


def test_the_runtime_hands_the_placement_settings_to_the_worker_group(monkeypatch):
    asked = {}

    class RecordingGroup:
        @classmethod
        def from_spec(cls, spec):
            asked.update(vars(spec))
            return cls()

    monkeypatch.setattr(factory, "worker_group_class", lambda placement: RecordingGroup)
    rt = runtime(num_gpus_per_worker=2, worker_resources={"rollout_node": 1}, worker_layout="per_gpu")
    rt._make_controller = lambda state: SimpleNamespace(weight_version=0)
    rt.start(policy=None)
    assert {k: asked[k] for k in ("num_workers", "num_cpus_per_worker", "num_gpus_per_worker")} == {
        "num_workers": 2,
        "num_cpus_per_worker": 1,
        "num_gpus_per_worker": 2,
    }
    assert asked["resources_per_worker"] == {"rollout_node": 1} and asked["layout"] == "per_gpu"


def test_vllm_tensor_parallel_size_follows_num_gpus_per_worker_or_must_agree():
    assert VLLMEngineConfig().tensor_parallel_size is None  # "follow num_gpus_per_worker"
    assert runtime(engine=VLLMEngineConfig(), num_gpus_per_worker=2).engine_config().tensor_parallel_size == 2
    assert runtime(engine=VLLMEngineConfig(), num_gpus_per_worker=0).engine_config().tensor_parallel_size == 1
    same = runtime(engine=VLLMEngineConfig(tensor_parallel_size=4), num_gpus_per_worker=4)
    assert same.engine_config().tensor_parallel_size == 4
    with pytest.raises(ValueError, match="tensor_parallel_size=1 and num_gpus_per_worker=2 disagree"):
        runtime(engine=VLLMEngineConfig(tensor_parallel_size=1), num_gpus_per_worker=2).engine_config()
    with pytest.raises(ValueError, match="tensor_parallel_size must be > 0"):
        VLLMEngineConfig(tensor_parallel_size=0)


def test_the_placement_settings_are_checked():
    with pytest.raises(ValueError, match="worker_layout"):
        settings(worker_layout="spread")
    with pytest.raises(ValueError, match="per_gpu.*whole num_gpus_per_worker"):
        settings(worker_layout="per_gpu", num_gpus_per_worker=0.5)
    with pytest.raises(
        ValueError, match=r"per_gpu.*>= 2 .*got 1: with one GPU per worker use worker_layout='actor'"
    ):
        settings(worker_layout="per_gpu", num_gpus_per_worker=1)
    with pytest.raises(ValueError, match="worker_resources\\['rollout_node'\\] must be > 0"):
        settings(worker_resources={"rollout_node": 0})


def _fake_trainer(device: str) -> SimpleNamespace:
    return SimpleNamespace(
        world_size=1, loggers=[], strategy=SimpleNamespace(root_device=torch.device(device))
    )


def test_a_worker_on_a_training_gpu_fails_setup_under_separate_placement(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,3")  # the trainer's cuda:1 is GPU 3
    ip = ray.util.get_node_ip_address()
    row = {
        "worker": 0,
        "node_ip": ip,
        "node_id": "n" * 56,
        "pid": 1,
        "gpu_ids": ["3"],
        "cuda_visible_devices": "3",
    }
    for placement in ("separate", "colocate"):
        rt = runtime(placement=placement, max_staleness=0, max_inflight=1)
        rt.workers = SimpleNamespace(call=lambda method, timeout_s: [dict(row)])
        if placement == "separate":
            with pytest.raises(
                RuntimeError, match="rollout worker 0 shares GPU 3 on .* with training rank 0"
            ):
                rt.report_placement(_fake_trainer("cuda:1"))
        else:  # colocated engines share the trainer's GPU by design
            report = rt.report_placement(_fake_trainer("cuda:1"))
            assert report["overlaps"] and report["trainers"][0]["gpu_ids"] == ["3"]
    rt.workers = SimpleNamespace(call=lambda method, timeout_s: [dict(row, gpu_ids=["5"])])
    assert rt.report_placement(_fake_trainer("cuda:1"))["overlaps"] == []


@pytest.mark.slow
def test_a_tiny_fit_writes_placement_json_into_its_log_folder(tmp_path, ray_local):
    strategy = AsyncRolloutStrategy(max_staleness=0, max_inflight=1, num_workers=2)
    try:
        trainer, _, _ = fit_tiny(tmp_path, max_steps=1, strategy=strategy)
        saved = json.loads((tmp_path / "run" / "version_0" / "placement.json").read_text())
        assert trainer.log_dir == str(tmp_path / "run" / "version_0")
    finally:
        strategy.shutdown()
    (row,) = saved["trainers"]
    assert row["rank"] == 0 and row["device"] == "cpu" and row["gpu_ids"] == [] and row["pid"] == os.getpid()
    assert [(w["rank"], w["worker"]) for w in saved["workers"]] == [(0, 0), (0, 1)]
    pids = {w["pid"] for w in saved["workers"]}
    assert len(pids) == 2 and os.getpid() not in pids  # the workers are actors of their own
    assert all(w["node_ip"] == row["node_ip"] and w["gpu_ids"] == [] for w in saved["workers"])
    assert saved["overlaps"] == []


def test_a_placement_that_fails_its_check_fails_before_the_first_push(monkeypatch):
    """The strategy's placement report runs between the workers' start and the first push: a worker on
    a training GPU fails with the overlap named, and no weight has been pushed (on GPUs a misplaced
    push would fail inside NCCL instead)."""
    monkeypatch.setattr(
        factory,
        "worker_group_class",
        lambda placement: SimpleNamespace(from_spec=lambda spec: SimpleNamespace()),
    )
    pushes = []
    rt = runtime()
    rt.weight_sync = SimpleNamespace(push=lambda *args: pushes.append(args))
    rt._make_controller = lambda state: SimpleNamespace(weight_version=0)

    def overlapping():
        raise ValueError("rollout worker 0 of rank 0 is on GPU 3, which training rank 0 holds")

    with pytest.raises(ValueError, match="which training rank 0 holds"):
        rt.start(policy=None, before_push=overlapping)
    assert pushes == []
    rt.start(policy=None, before_push=lambda: None)
    assert len(pushes) == 1


def test_reward_workers_start_beside_the_rollout_workers_which_then_score_nothing(monkeypatch):
    import unirl_lightning.workers.reward as reward_module
    from unirl_lightning.runtime import RewardWorkers

    asked, pools = {}, []

    class RecordingGroup:
        @classmethod
        def from_spec(cls, spec):
            asked.update(vars(spec))
            return cls()

    class RecordingPool:
        def __init__(self, reward, settings, max_restarts):
            pools.append((reward, settings, max_restarts))

    monkeypatch.setattr(factory, "worker_group_class", lambda placement: RecordingGroup)
    monkeypatch.setattr(reward_module, "RewardWorkerPool", RecordingPool)
    rt = runtime(reward_workers={"num_workers": 2, "num_gpus_per_worker": 0.5}, max_worker_restarts=2)
    rt.spec.reward = "the module's reward"
    rt._make_controller = lambda state: SimpleNamespace(weight_version=0)
    rt.start(policy=None)
    assert pools == [("the module's reward", RewardWorkers(num_workers=2, num_gpus_per_worker=0.5), 2)]
    assert asked["reward"] is None and asked["reward_pool"] is rt.reward_pool
    rt.start(policy=None)  # a second start (the next fit) keeps its pool
    assert len(pools) == 1


def test_the_reward_worker_settings_are_checked_naming_the_key():
    from unirl_lightning.runtime import RewardWorkers

    with pytest.raises(ValueError, match=r"reward_workers.num_workers must be >= 1, got 0"):
        settings(reward_workers={"num_workers": 0})
    with pytest.raises(ValueError, match=r"reward_workers.num_gpus_per_worker must be >= 0, got -1"):
        RewardWorkers(num_gpus_per_worker=-1)
    with pytest.raises(ValueError, match=r"reward_workers.resources_per_worker\['rm'\] must be > 0"):
        RewardWorkers(resources_per_worker={"rm": 0})


def test_a_reward_worker_on_a_training_gpu_fails_setup_whatever_the_placement(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,3")
    ip = ray.util.get_node_ip_address()
    row = {"node_ip": ip, "node_id": "n" * 56, "pid": 1, "cuda_visible_devices": "3"}
    for placement in ("separate", "colocate"):
        rt = runtime(placement=placement, max_staleness=0, max_inflight=1)
        rt.workers = SimpleNamespace(call=lambda method, timeout_s: [dict(row, worker=0, gpu_ids=["5"])])
        rt.reward_pool = SimpleNamespace(
            call=lambda method, timeout_s: [dict(row, reward_worker=0, gpu_ids=["3"])]
        )
        with pytest.raises(RuntimeError, match="reward worker 0 shares GPU 3 on .* with training rank 0"):
            rt.report_placement(_fake_trainer("cuda:1"))
    rt.reward_pool = SimpleNamespace(
        call=lambda method, timeout_s: [dict(row, reward_worker=0, gpu_ids=["7"])]
    )
    report = rt.report_placement(_fake_trainer("cuda:1"))
    assert [w["gpu_ids"] for w in report["reward_workers"]] == [["7"]]


def test_an_agentic_module_refuses_reward_workers_naming_the_key():
    from unirl_lightning.runtime.agentic import AgenticRuntime

    spec = SimpleNamespace(family="token", policy=TinyCausalLM(), lora=None, reward=None, agentic=object())
    rt = AgenticRuntime(spec, settings(reward_workers={"num_workers": 1}), weight_sync=None)
    with pytest.raises(ValueError, match="reward_workers .* set reward_workers to null"):
        rt.check()
