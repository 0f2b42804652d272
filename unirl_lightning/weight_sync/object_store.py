"""Default weight sync: one ``ray.put`` of the CPU weights (:class:`PackedWeights`), every worker loads it."""

from __future__ import annotations

import time
from typing import Any

import ray
import torch

from unirl_lightning.checks import require_positive
from unirl_lightning.weight_sync.base import SyncStats, named_weights, tensor_bytes
from unirl_lightning.weight_sync.buckets import PackedWeights


class ObjectStoreWeightSync:
    """Push through Ray's object store: simple, works across nodes, one copy per node.

    Args:
        timeout_s: how long every worker may take to load a push; then a ``TimeoutError`` names
            the version.

    Example::

        AsyncRolloutStrategy(weight_sync=ObjectStoreWeightSync(timeout_s=300))
    """

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = require_positive("timeout_s", timeout_s)

    def push(self, model: torch.nn.Module, workers: Any, weight_version: int) -> SyncStats:
        start = time.perf_counter()
        tensors = named_weights(model)
        ref = ray.put(PackedWeights.pack(tensors.items()))  # one object; each tensor copied once, into it
        try:
            ray.get(
                [w.load_weights.remote(ref, weight_version) for w in workers.workers], timeout=self.timeout_s
            )
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(
                f"rollout workers did not load weight_version {weight_version} within timeout_s={self.timeout_s} s"
            ) from exc
        del ref
        return SyncStats(time.perf_counter() - start, tensor_bytes(tensors), len(tensors))

    def close(self) -> None:
        pass
