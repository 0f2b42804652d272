"""Default weight sync: one ``ray.put`` of the CPU state, every worker loads it."""

from __future__ import annotations

import time
from typing import Any

import ray
import torch

from unirl_lightning.weight_sync.base import SyncStats, named_weights, tensor_bytes


class ObjectStoreWeightSync:
    """Push through Ray's object store: simple, works across nodes, one copy per node.

    Example::

        AsyncRolloutStrategy(weight_sync=ObjectStoreWeightSync())
    """

    def push(self, model: torch.nn.Module, workers: Any, weight_version: int) -> SyncStats:
        start = time.perf_counter()
        tensors = {k: v.to("cpu", copy=True) for k, v in named_weights(model).items()}
        ref = ray.put(tensors)
        ray.get([w.load_weights.remote(ref, weight_version) for w in workers.workers])
        del ref
        return SyncStats(time.perf_counter() - start, tensor_bytes(tensors), len(tensors))

    def close(self) -> None:
        pass
