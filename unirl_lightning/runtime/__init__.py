"""Rollout runtimes: one per family, each the rollout side of a module behind one small interface.

:func:`runtime_for` picks the family's runtime for a module's rollout spec; the strategy calls it
and never branches on the family itself.
"""

from __future__ import annotations

from typing import Any

from unirl_lightning.runtime.base import (
    Placement,
    RewardWorkers,
    RolloutRuntime,
    RolloutSettings,
    check_rollout_settings,
    cpu_threads,
    rank_share,
)

__all__ = [
    "Placement",
    "RewardWorkers",
    "RolloutRuntime",
    "RolloutSettings",
    "check_rollout_settings",
    "cpu_threads",
    "rank_share",
    "runtime_for",
]


def runtime_for(spec: Any) -> type[RolloutRuntime]:
    """The runtime class of a module's :class:`~unirl_lightning.modules.base.RolloutSpec`: episodes
    when it has an ``agentic`` part, batches otherwise."""
    if spec.agentic is not None:
        from unirl_lightning.runtime.agentic import AgenticRuntime

        return AgenticRuntime
    from unirl_lightning.runtime.batch import BatchRuntime

    return BatchRuntime
