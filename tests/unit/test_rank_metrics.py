"""The logged metric vector is the union of the ranks' keys: two gloo ranks, a key only rank 1 has
(a reward part, an eviction counter) is logged, and every shared key is the mean over the ranks."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from unirl_lightning.modules.ranks import mean_over_ranks

RANK_METRICS = [
    {"rollout/reward_mean": 0.25, "train/loss": 1.0},
    {
        "rollout/reward_mean": 0.75,
        "train/loss": 3.0,
        "rollout/reward/judge_mean": 0.5,
        "rollout/evicted": 2.0,
    },
]


def _rank(rank: int, store_dir: str) -> None:
    torch.set_num_threads(1)
    store = torch.distributed.FileStore(os.path.join(store_dir, "store"), 2)
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        torch.save(mean_over_ranks(RANK_METRICS[rank], "cpu"), os.path.join(store_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def test_a_key_only_one_rank_has_is_logged_and_shared_keys_are_averaged():
    with tempfile.TemporaryDirectory() as store_dir:
        mp.spawn(_rank, args=(store_dir,), nprocs=2, join=True)
        reduced = [torch.load(Path(store_dir) / f"rank{r}.pt") for r in (0, 1)]
    expected = {
        "rollout/evicted": 2.0,  # rank 1's own: its value, not halved
        "rollout/reward/judge_mean": 0.5,
        "rollout/reward_mean": 0.5,
        "train/loss": 2.0,
    }
    assert reduced[0] == reduced[1] == expected


def test_one_rank_logs_its_own_figures_as_floats():
    assert mean_over_ranks({"b": 2, "a": 1}, "cpu") == {"a": 1.0, "b": 2.0}
