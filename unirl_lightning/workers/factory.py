"""The worker group of a placement: Ray actors, or the engine in the training process.

Contract:

* :func:`worker_group_class` maps ``placement`` to the class the rollout runtime builds its workers
  with: :class:`~unirl_lightning.workers.group.RolloutWorkerGroup` (Ray actors) for ``separate`` and
  ``colocate``, :class:`~unirl_lightning.workers.inprocess.InProcessWorkerGroup` for ``hybrid``. Only
  the chosen class's module is imported, so a hybrid run never imports ``ray``.
* Every group class is a :class:`WorkerGroup`: built from one :class:`WorkerGroupSpec`
  (``from_spec``; each class reads the fields that mean something to it: the in-process group has no
  Ray resources, timeouts or restarts), with ``generate`` (a ready/wait/result handle answering a
  :class:`~unirl_lightning.rollout.records.GenerationResult`), ``call``, ``subset``,
  ``ensure_alive``, ``replace``, ``shutdown``, ``workers``, ``restarts``, ``max_restarts``,
  ``on_restart``, ``shares_trainer_device``; and three class methods for what a run's processes
  share: ``connect(rank, world_size, settings, trainer_devices, broadcast)`` on every rank before any
  worker starts (Ray: start or join the cluster), ``leave(rank)`` for a joined rank at teardown,
  ``release()`` at shutdown (Ray: stop the local Ray this process started). The in-process group's
  are no-ops.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from unirl_lightning.core.checks import require_choice
from unirl_lightning.core.preflight import PLACEMENTS, WorkerLayout

__all__ = ["GROUP_CLASSES", "WorkerGroup", "WorkerGroupSpec", "worker_group_class"]


@dataclass(frozen=True)
class WorkerGroupSpec:
    """What a rollout runtime asks of the worker group of its placement.

    Args:
        engine_config / policy / lora: what each engine serves (``engine_config.build(policy, lora)``).
        reward: scores each sample where it was generated (None: ``reward_pool`` scores).
        reward_pool: the reward's own Ray actors (``reward_workers``), or None.
        worker_cls: the worker class (:class:`~unirl_lightning.workers.actor.RolloutWorker` or a
            family's subclass).
        num_workers / num_cpus_per_worker / num_gpus_per_worker / resources_per_worker / layout: the
            Ray resources of each worker and how they are placed.
        generation_timeout_s: how long a call may run before its worker is presumed dead.
        max_restarts: how many dead workers the group replaces before it gives up.
        shares_trainer_device: the engines use the training device (``colocate``, ``hybrid``).
        share_weights: the in-process engine may serve the trainer's own tensors (a push every step).
    """

    engine_config: Any
    policy: Any
    lora: Any = None
    reward: Any = None
    reward_pool: Any = None
    worker_cls: type | None = None
    num_workers: int = 1
    num_cpus_per_worker: float = 1
    num_gpus_per_worker: float = 0
    resources_per_worker: dict[str, float] | None = None
    layout: WorkerLayout = "actor"
    generation_timeout_s: float = 600.0
    max_restarts: int = 3
    shares_trainer_device: bool = False
    share_weights: bool = False


class WorkerGroup(Protocol):
    """The rollout workers of one training rank: Ray actors or the engine in the training process."""

    workers: list[Any]
    restarts: int
    max_restarts: int
    on_restart: Callable[[int], None] | None
    shares_trainer_device: bool

    @classmethod
    def from_spec(cls, spec: WorkerGroupSpec) -> WorkerGroup: ...

    @classmethod
    def connect(
        cls, rank: int, world_size: int, settings: Any, trainer_devices: Sequence[Any], broadcast: Any
    ) -> None: ...

    @classmethod
    def leave(cls, rank: int) -> None: ...

    @classmethod
    def release(cls) -> None: ...

    def generate(self, request: Any) -> Any: ...

    def call(self, method: str, *args: Any, timeout_s: float | None = 600.0, **kwargs: Any) -> list[Any]: ...

    def subset(self, indices: list[int]) -> Any: ...

    def ensure_alive(self, timeout_s: float = 30.0) -> None: ...

    def replace(self, index: int, actor: Any, why: str) -> None: ...

    def shutdown(self) -> None: ...


GROUP_CLASSES: dict[str, str] = {
    "separate": "unirl_lightning.workers.group:RolloutWorkerGroup",
    "colocate": "unirl_lightning.workers.group:RolloutWorkerGroup",
    "hybrid": "unirl_lightning.workers.inprocess:InProcessWorkerGroup",
}
"""``placement`` -> ``module:class`` of its worker group (imported on demand)."""


def worker_group_class(placement: str) -> type[WorkerGroup]:
    """The worker group class of ``placement`` (``ValueError`` naming the allowed placements)."""
    require_choice("placement", placement, PLACEMENTS)
    module, _, name = GROUP_CLASSES[placement].partition(":")
    return getattr(importlib.import_module(module), name)
