"""Rewards for the multi-rank fault tests, importable by class path from a CLI run (each rank builds
its own module, so ``LOCAL_RANK`` says which rank a reward belongs to)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from unirl_lightning.rewards import CombinedReward, ExactMatchReward, FormatReward


class FailingReward(ExactMatchReward):
    """Exact match that raises at its ``at_call``-th call in the rollout worker of rank ``rank`` only;
    the time of the raise goes to ``out/raised_at``."""

    def __init__(self, rank: int, at_call: int, out: str) -> None:
        super().__init__()
        self.fails = int(os.environ.get("LOCAL_RANK", "0")) == rank
        self.rank, self.at_call, self.out, self.calls = rank, at_call, str(out), 0

    def __call__(self, completions, records):
        self.calls += 1
        if self.fails and self.calls == self.at_call:
            Path(self.out, "raised_at").write_text(repr(time.time()))
            raise RuntimeError(f"injected reward failure on rank {self.rank} at call {self.at_call}")
        return super().__call__(completions, records)


class RankOnePart(CombinedReward):
    """Exact match on every rank, plus a part named ``rank1_only`` (a digit anywhere) on rank 1 only:
    the ranks then log different reward keys."""

    def __init__(self) -> None:
        parts = [ExactMatchReward()]
        if int(os.environ.get("LOCAL_RANK", "0")) == 1:
            part = FormatReward(r"\d")
            part.name = "rank1_only"
            parts.append(part)
        super().__init__(parts)
