"""Moving weights trainer -> rollout engines.

Every backend implements ``push(model, workers, weight_version) -> SyncStats``; the rollout
controller's ``sync_weights`` calls it (through the strategy) only when nothing is in flight, then
advances the version ledger. Backends: :class:`ObjectStoreWeightSync` (default),
:class:`CollectiveWeightSync` (a standalone torch.distributed group, gloo on CPU / nccl on GPU).
"""

from typing import Literal

from unirl_lightning.checks import require_choice
from unirl_lightning.weight_sync.base import PushTargets, SyncStats, WeightSync, named_weights
from unirl_lightning.weight_sync.collective import CollectiveWeightSync
from unirl_lightning.weight_sync.object_store import ObjectStoreWeightSync

__all__ = [
    "CollectiveWeightSync",
    "ObjectStoreWeightSync",
    "PushTargets",
    "SyncStats",
    "WeightSync",
    "WeightSyncName",
    "named_weights",
    "resolve_weight_sync",
]


WeightSyncName = Literal["object_store", "collective"]


def resolve_weight_sync(spec: "WeightSyncName | WeightSync") -> WeightSync:
    """``"object_store"`` | ``"collective"`` | an instance."""
    if not isinstance(spec, str):
        return spec
    require_choice("weight_sync", spec, WeightSyncName)
    return {"object_store": ObjectStoreWeightSync, "collective": CollectiveWeightSync}[spec]()
