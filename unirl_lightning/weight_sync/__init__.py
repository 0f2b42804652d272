"""Moving weights trainer -> rollout engines.

Every backend implements ``push(model, workers, weight_version) -> SyncStats``; the rollout
controller's ``sync_weights`` calls it (through the strategy) only when nothing is in flight, then
advances the version ledger. Backends: :class:`ObjectStoreWeightSync` (default),
:class:`CollectiveWeightSync` (a standalone torch.distributed group, gloo on CPU / nccl on GPU).
"""

from unirl_lightning.weight_sync.base import SyncStats, WeightSync, named_weights
from unirl_lightning.weight_sync.collective import CollectiveWeightSync
from unirl_lightning.weight_sync.object_store import ObjectStoreWeightSync

__all__ = [
    "CollectiveWeightSync",
    "ObjectStoreWeightSync",
    "SyncStats",
    "WeightSync",
    "named_weights",
    "resolve_weight_sync",
]


def resolve_weight_sync(spec: "str | WeightSync") -> WeightSync:
    """``"object_store"`` | ``"collective"`` | an instance."""
    if not isinstance(spec, str):
        return spec
    choices = {"object_store": ObjectStoreWeightSync, "collective": CollectiveWeightSync}
    if spec not in choices:
        raise ValueError(
            f"weight_sync must be one of {sorted(choices)} or a WeightSync instance, got {spec!r}"
        )
    return choices[spec]()
