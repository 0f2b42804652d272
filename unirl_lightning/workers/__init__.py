"""Rollout workers on Ray: engines in actors, calls that return pending handles."""

from unirl_lightning.workers.group import (
    PendingCall,
    RolloutWorker,
    RolloutWorkerGroup,
    WorkerSubset,
    ensure_ray,
)

__all__ = ["PendingCall", "RolloutWorker", "RolloutWorkerGroup", "WorkerSubset", "ensure_ray"]
