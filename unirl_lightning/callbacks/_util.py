"""Shared checks for the rollout callbacks."""

from __future__ import annotations

from typing import Any


def rollout_strategy(trainer: Any, who: str) -> Any:
    from unirl_lightning.strategy import AsyncRolloutStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, AsyncRolloutStrategy):
        raise RuntimeError(
            f"{who} needs Trainer(strategy=AsyncRolloutStrategy(...)) (or strategy: async_rollout in YAML), "
            f"got {type(strategy).__name__}"
        )
    return strategy


def check_every_n_steps(value: int) -> int:
    if value < 1:
        raise ValueError(f"every_n_steps must be >= 1, got {value}")
    return value
