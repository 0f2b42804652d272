"""One seeding rule (``unirl_lightning.core.seeding``): rollout seeds are hashes of their path and never
collide in practice; data seeds keep the values that fix the held-out sets and the pass orders."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from unirl_lightning.core.seeding import (
    VAL_SEED_OFFSET,
    derive_seed,
    episode_seed,
    eval_episode_seed,
    held_out_seed,
    pass_seed,
    rank_seed,
    turn_seed,
)
from unirl_lightning.data import PromptDataModule
from unirl_lightning.data.datamodule import PassSampler

PACKAGE = Path(__file__).resolve().parents[2] / "unirl_lightning"


def test_two_ranks_times_a_hundred_thousand_groups_draw_no_common_seed():
    n = 4
    seeds = [
        episode_seed(rank_seed(0, rank), g, k) for rank in (0, 1) for g in range(100_000) for k in range(n)
    ]
    assert len(set(seeds)) == len(seeds) == 800_000
    # the sums this replaced: rank 1's first episode was rank 0's episode of group 1_000_003 / n
    old = lambda rank, g, k: rank * 1_000_003 + g * n + k  # noqa: E731
    assert old(1, 0, 3) == old(0, 250_001, 2)


def test_evaluation_episodes_never_replay_a_training_episode():
    train = {episode_seed(7, g, k) for g in range(200) for k in range(4)}
    assert not train & {eval_episode_seed(7, i, k) for i in range(200) for k in range(4)}


def test_turn_seeds_hash_the_episode_and_the_turn():
    assert turn_seed(3, 1) == derive_seed(3, 1) != turn_seed(1, 3)


def test_derive_seed_is_defined_once_and_no_seed_sum_constant_is_left():
    defs = [
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name in ("derive_seed", "turn_seed", "call_seed")
    ]
    assert defs == ["core/seeding.py"] * 3
    carriers = [p.name for p in PACKAGE.rglob("*.py") if re.search(r"1_?000_?003", p.read_text())]
    assert carriers == ["seeding.py"]


def test_the_data_seeds_keep_their_historical_values():
    assert VAL_SEED_OFFSET == 1_000_003 and held_out_seed(3) == 3 + 1_000_003 and pass_seed(3, 2) == 5
    # the pass order is DistributedSampler's: randperm under a generator seeded seed + epoch
    import torch

    sampler = PassSampler(10, shuffle=True, seed=3)
    sampler.set_epoch(2)
    assert list(sampler) == torch.randperm(10, generator=torch.Generator().manual_seed(5)).tolist()


def test_the_held_out_sets_are_those_of_before_the_seeding_module():
    """A built-in task's held-out records, pinned as the code before the seeding module drew them."""
    data = PromptDataModule(train="add_mod10", num_train_prompts=8, num_val_prompts=6, seed=3)
    data.setup("fit")
    assert [r["prompt"] for r in data.val_records()] == PINNED_ADD_MOD10_HELD_OUT


PINNED_ADD_MOD10_HELD_OUT = ["5+9=", "3+6=", "0+5=", "8+6=", "9+3=", "9+9="]
