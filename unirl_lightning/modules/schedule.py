"""Learning-rate schedules of the RL modules: a linear warmup, then constant, linear or cosine decay,
stepped once per optimizer step (the module multiplies its settings, ``warmup_steps`` and
``trainer.max_steps``, both in RL steps, by the optimizer steps per RL step), as Hugging Face's
``get_{constant,linear,cosine}_schedule_with_warmup`` define them (TRL's ``lr_scheduler_type`` and
``warmup_steps``): during warmup the factor is ``step / warmup_steps`` (0 at the first step), then
``1``, ``(total - step) / (total - warmup_steps)`` or ``(1 + cos(pi * progress)) / 2``."""

from __future__ import annotations

import math
from typing import Literal

from unirl_lightning.core.checks import require_at_least, require_choice

__all__ = ["LRSchedule", "lr_factor", "check_schedule"]

LRSchedule = Literal["constant", "linear", "cosine"]


def check_schedule(lr_schedule: str, warmup_steps: int) -> None:
    require_choice("lr_schedule", lr_schedule, LRSchedule)
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool):
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    require_at_least("warmup_steps", warmup_steps, 0)


def lr_factor(step: int, lr_schedule: str, warmup_steps: int, total_steps: int | None) -> float:
    """The multiplier of the base learning rate at optimizer step ``step`` (0-based).

    >>> [round(lr_factor(s, "cosine", 2, 6), 3) for s in range(7)]
    [0.0, 0.5, 1.0, 0.854, 0.5, 0.146, 0.0]
    >>> [lr_factor(s, "linear", 0, 4) for s in range(5)]
    [1.0, 0.75, 0.5, 0.25, 0.0]
    """
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if lr_schedule == "constant":
        return 1.0
    assert total_steps is not None, "a decaying schedule needs the total step count"
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if lr_schedule == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))
