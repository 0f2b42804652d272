"""The worker group of a placement: Ray actors, or the engine in the training process.

Contract:

* :func:`worker_group_class` maps ``placement`` to the class the rollout runtime builds its workers
  with: :class:`~unirl_lightning.workers.group.RolloutWorkerGroup` (Ray actors) for ``separate`` and
  ``colocate``, :class:`~unirl_lightning.workers.inprocess.InProcessWorkerGroup` for ``hybrid``. Only
  the chosen class's module is imported, so a hybrid run never imports ``ray``.
* Every group class takes the same constructor arguments and has the same interface: ``generate``
  (a ready/wait/result handle), ``call``, ``subset``, ``ensure_alive``, ``replace``, ``shutdown``,
  ``workers``, ``restarts``, ``max_restarts``, ``on_restart``, ``shares_trainer_device``; and three
  class methods for what a run's processes share: ``connect(rank, world_size, settings,
  trainer_devices, broadcast)`` on every rank before any worker starts (Ray: start or join the
  cluster), ``leave(rank)`` for a joined rank at teardown, ``release()`` at shutdown (Ray: stop the
  local Ray this process started). The in-process group's are no-ops.
"""

from __future__ import annotations

import importlib

from unirl_lightning.checks import require_choice
from unirl_lightning.preflight import PLACEMENTS

__all__ = ["GROUP_CLASSES", "worker_group_class"]

GROUP_CLASSES: dict[str, str] = {
    "separate": "unirl_lightning.workers.group:RolloutWorkerGroup",
    "colocate": "unirl_lightning.workers.group:RolloutWorkerGroup",
    "hybrid": "unirl_lightning.workers.inprocess:InProcessWorkerGroup",
}
"""``placement`` -> ``module:class`` of its worker group (imported on demand)."""


def worker_group_class(placement: str) -> type:
    """The worker group class of ``placement`` (``ValueError`` naming the allowed placements)."""
    require_choice("placement", placement, PLACEMENTS)
    module, _, name = GROUP_CLASSES[placement].partition(":")
    return getattr(importlib.import_module(module), name)
