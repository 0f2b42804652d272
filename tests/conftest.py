"""Fixtures for every test folder: one real local Ray per session (started on first use)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault(
    "RAY_AUTH_MODE", "token"
)  # token auth on, without Ray's start-up warning (before ray loads)
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from unirl_lightning.workers.cluster import shutdown_ray_if_owned

    torch.set_num_threads(1)
    # a local Ray an earlier test's run started and left (sized to this machine's CPUs): the tests below
    # assume this one's 16, and a later run's teardown must not stop it
    shutdown_ray_if_owned()
    if ray.is_initialized():  # one a bare ray call started with this machine's CPUs
        ray.shutdown()
    if not ray.is_initialized():
        ray.init(num_cpus=16, include_dashboard=False, object_store_memory=256 * 1024**2, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def no_global_seed_left_behind():
    """``seed_everything`` leaves its seed in ``PL_GLOBAL_SEED``, which default seeds follow (the
    strategy's rollout seed, LoRA's init): a test that seeds must not change the next test's run."""
    os.environ.pop("PL_GLOBAL_SEED", None)
    yield
    os.environ.pop("PL_GLOBAL_SEED", None)
