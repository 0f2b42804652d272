"""Rollout workers: engines in Ray actors, or in the training process, called through one interface.

One concern a file: ``cluster`` (Ray's lifecycle), ``actor`` (the generic worker), ``agentic_actor``
(its episode endpoints), ``calls`` (fault-tolerant generation calls), ``group`` (the Ray worker
group), ``inprocess`` (the engine in the training process: ``placement="hybrid"``), ``factory`` (the
group of a placement), ``agentic`` (the driver's handle on the workers' episode coordinators).

The names below are imported on first use, so that importing this package (or the in-process group)
never imports ``ray``; the Ray group's modules import it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "GenerationCall": "unirl_lightning.workers.calls",
    "WorkerSubset": "unirl_lightning.workers.calls",
    "RolloutWorker": "unirl_lightning.workers.actor",
    "RolloutWorkerGroup": "unirl_lightning.workers.group",
    "InProcessWorkerGroup": "unirl_lightning.workers.inprocess",
    "worker_group_class": "unirl_lightning.workers.factory",
    "ensure_ray": "unirl_lightning.workers.cluster",
    "shutdown_ray_if_owned": "unirl_lightning.workers.cluster",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'unirl_lightning.workers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
