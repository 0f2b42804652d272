"""Default weight sync: one ``ray.put`` of the CPU weights (:class:`PackedWeights`), every worker loads it.

Floating tensors travel in the model's serving dtype (:func:`~unirl_lightning.weight_sync.base.serving_dtype`:
bf16 for a bf16 policy trained on float32 masters), cast one tensor at a time.

The last push stays in the object store (its ref and version) until the next one, so a replaced
worker gets it again (:meth:`ObjectStoreWeightSync.resend`): no gather, no new copy. Under FSDP
that is what keeps a replacement from entering a gather the other ranks are not in."""

from __future__ import annotations

import time
from typing import Any

import ray
import torch

from unirl_lightning.checks import require_positive
from unirl_lightning.weight_sync.base import SyncStats, named_weights, serving_dtype, tensor_bytes
from unirl_lightning.weight_sync.buckets import PackedWeights


class ObjectStoreWeightSync:
    """Push through Ray's object store: simple, works across nodes, one copy per node.

    The last push is kept (one object per training rank, the size of the pushed weights: e.g.
    ~1 GB for a 0.5B bf16 policy) and released just before the next push puts its own, so at
    most one push per rank is held besides the one being made.

    Args:
        timeout_s: how long every worker may take to load a push; then a ``TimeoutError`` names
            the version.

    Example::

        AsyncRolloutStrategy(weight_sync=ObjectStoreWeightSync(timeout_s=300))
    """

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = require_positive("timeout_s", timeout_s)
        self._last: tuple[Any, int, SyncStats] | None = None  # (ref, weight_version, stats) of the last push

    def push(self, model: torch.nn.Module, workers: Any, weight_version: int) -> SyncStats:
        start = time.perf_counter()
        dtype = serving_dtype(model)  # float32 masters of a bf16 policy travel as bf16
        tensors = named_weights(model, dtype)
        self._last = None  # release the previous push before the next one is put
        # one object; each tensor cast (one at a time) and copied once, into it
        ref = ray.put(PackedWeights.pack(tensors.items(), dtype))
        self._load(ref, workers, weight_version)
        stats = SyncStats(time.perf_counter() - start, tensor_bytes(tensors, dtype), len(tensors))
        self._last = (ref, weight_version, stats)
        return stats

    def resend(self, workers: Any, weight_version: int) -> SyncStats | None:
        """Load the last push into ``workers`` (e.g. a replaced worker) when it was of
        ``weight_version``: no gather (no collective), no new copy. None when there is no such push
        (nothing pushed yet, or the last push was of another version)."""
        if self._last is None or self._last[1] != weight_version:
            return None
        ref, _, pushed = self._last
        start = time.perf_counter()
        self._load(ref, workers, weight_version)
        return SyncStats(time.perf_counter() - start, pushed.bytes, pushed.num_tensors)

    def _load(self, ref: Any, workers: Any, weight_version: int) -> None:
        try:
            ray.get(
                [w.load_weights.remote(ref, weight_version) for w in workers.workers], timeout=self.timeout_s
            )
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(
                f"rollout workers did not load weight_version {weight_version} within timeout_s={self.timeout_s} s"
            ) from exc

    def close(self) -> None:
        self._last = None  # the kept push leaves the object store
