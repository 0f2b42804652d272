"""Rollout and reward workers run at the driver's scheduling priority, not at Ray's default
``nice 15`` (under which any process of normal priority on the node preempts a worker, and a
worker's multi-threaded torch waits at every OpenMP barrier for its descheduled threads)."""

from __future__ import annotations

import os

import pytest

from unirl_lightning.engines.hf import HFEngineConfig
from unirl_lightning.models.causal_lm import TinyCausalLM
from unirl_lightning.rewards import ExactMatchReward
from unirl_lightning.runtime import RewardWorkers
from unirl_lightning.workers.cluster import worker_runtime_env
from unirl_lightning.workers.group import RolloutWorkerGroup
from unirl_lightning.workers.reward import RewardWorkerPool

pytestmark = pytest.mark.usefixtures("ray_local")

POLICY = TinyCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


def niceness(worker) -> int:  # noqa: ANN001
    return os.nice(0)


def omp_threads(worker) -> tuple[str | None, int]:  # noqa: ANN001
    import torch

    return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


def test_rollout_and_reward_workers_run_at_the_drivers_priority():
    driver = os.nice(0)
    pool = RewardWorkerPool(ExactMatchReward(), RewardWorkers(num_workers=1))
    group = RolloutWorkerGroup(
        HFEngineConfig(num_threads=2), POLICY, reward=None, reward_pool=pool, num_workers=1
    )
    try:
        assert group.call("run", niceness) == [driver]
        assert group.call("run", omp_threads) == [("2", 2)]  # the OpenMP runtime starts at the engine's count
        assert pool.call("run", niceness) == [driver]
        # Ray's own default, for comparison: a bare task of this cluster runs 15 steps lower
        import ray

        bare = ray.remote(num_cpus=0)(lambda: os.nice(0))
        assert ray.get(bare.remote()) == min(19, driver + 15)
    finally:
        group.shutdown()
        pool.shutdown()


def test_the_runtime_env_keeps_the_callers_settings_and_an_explicit_niceness(monkeypatch):
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    assert worker_runtime_env(None) == {"env_vars": {"RAY_worker_niceness": "0"}}
    mine = {"pip": ["x"], "env_vars": {"A": "1", "RAY_worker_niceness": "5"}}
    assert worker_runtime_env(mine) == mine and mine["env_vars"]["RAY_worker_niceness"] == "5"
    assert worker_runtime_env({"env_vars": {"A": "1"}})["env_vars"] == {"A": "1", "RAY_worker_niceness": "0"}
    assert worker_runtime_env(None, threads=3)["env_vars"]["OMP_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS" not in worker_runtime_env(None, threads="auto")["env_vars"]
    assert (
        worker_runtime_env({"env_vars": {"OMP_NUM_THREADS": "1"}}, threads=3)["env_vars"]["OMP_NUM_THREADS"]
        == "1"
    )
    monkeypatch.setenv("RAY_worker_niceness", "10")  # the driver's own choice is passed on
    assert worker_runtime_env()["env_vars"]["RAY_worker_niceness"] == "10"
