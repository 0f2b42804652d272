"""Rollout workers on Ray: engines in actors, calls that return handles at once.

One concern a file: ``cluster`` (Ray's lifecycle), ``actor`` (the generic worker), ``agentic_actor``
(its episode endpoints), ``calls`` (fault-tolerant generation calls), ``group`` (the worker group),
``agentic`` (the driver's handle on the workers' episode coordinators).
"""

from unirl_lightning.workers.actor import RolloutWorker
from unirl_lightning.workers.calls import GenerationCall
from unirl_lightning.workers.cluster import ensure_ray, shutdown_ray_if_owned
from unirl_lightning.workers.group import RolloutWorkerGroup, WorkerSubset

__all__ = [
    "GenerationCall",
    "RolloutWorker",
    "RolloutWorkerGroup",
    "WorkerSubset",
    "ensure_ray",
    "shutdown_ray_if_owned",
]
