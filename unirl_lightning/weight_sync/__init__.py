"""Moving weights trainer -> rollout engines.

Every backend implements ``push(model, workers, weight_version) -> SyncStats``; the rollout
controller's ``sync_weights`` calls it (through the strategy) only when nothing is in flight, then
advances the version ledger. Backends: :class:`ObjectStoreWeightSync` (the Ray workers' default),
:class:`CollectiveWeightSync` (a standalone torch.distributed group, gloo on CPU / nccl on GPU), and
:class:`InProcessWeightSync` (the in-memory copy of ``placement="hybrid"``, its only backend).
``"auto"`` is the backend that goes with the placement's worker group
(:func:`~unirl_lightning.core.preflight.resolve_weight_sync_name`).
"""

from unirl_lightning.core.checks import require_choice
from unirl_lightning.core.preflight import WeightSyncName, resolve_weight_sync_name
from unirl_lightning.weight_sync.base import PushTargets, SyncStats, WeightSync, named_weights
from unirl_lightning.weight_sync.collective import CollectiveWeightSync
from unirl_lightning.weight_sync.inprocess import InProcessWeightSync
from unirl_lightning.weight_sync.object_store import ObjectStoreWeightSync

__all__ = [
    "CollectiveWeightSync",
    "InProcessWeightSync",
    "ObjectStoreWeightSync",
    "PushTargets",
    "SyncStats",
    "WeightSync",
    "WeightSyncName",
    "named_weights",
    "resolve_weight_sync",
    "weight_sync_kind",
]


BACKENDS: dict[str, type] = {
    "object_store": ObjectStoreWeightSync,
    "collective": CollectiveWeightSync,
    "inprocess": InProcessWeightSync,
}


def resolve_weight_sync(spec: "WeightSyncName | WeightSync", placement: str = "separate") -> WeightSync:
    """``"auto"`` (the placement's backend) | ``"object_store"`` | ``"collective"`` | ``"inprocess"`` |
    an instance (returned as is)."""
    if not isinstance(spec, str):
        return spec
    require_choice("weight_sync", spec, WeightSyncName)
    return BACKENDS[resolve_weight_sync_name(placement, spec)]()


def weight_sync_kind(backend: WeightSync) -> str:
    """The name of a backend object's kind, as the setup rules read it: ``"object_store"``,
    ``"collective"``, ``"inprocess"``, or ``"other"`` (a user's own backend)."""
    return next((name for name, cls in BACKENDS.items() if isinstance(backend, cls)), "other")
