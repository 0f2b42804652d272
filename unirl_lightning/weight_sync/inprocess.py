"""The hybrid engine's weight sync: an in-memory copy within the training process (no Ray, no serialisation).

Contract: :meth:`InProcessWeightSync.push` hands the trainer's weights to each in-process worker's
engine (``workers.workers``: :class:`~unirl_lightning.workers.actor.RolloutWorker` objects in this
process, of an :class:`~unirl_lightning.workers.inprocess.InProcessWorkerGroup`).

* An engine with ``share_weights(named_tensors, weight_version) -> bytes copied`` (HF) is given the
  trainer's tensors as held, when the group allows it (``workers.share_weights``: a sync after every
  step): it reads each one directly where dtype, device and shape agree (zero copy: the trainer's
  later updates are visible to it only after the next sync, as generation and training take turns)
  and copies the others in place, cast (e.g. float32 masters into a bf16 engine).
* Every other engine (or when the group does not allow sharing) gets the weights in the serving dtype
  (:func:`~unirl_lightning.weight_sync.base.serving_dtype`), streamed in buckets of at most
  ``bucket_mb`` (a decoder layer is never split), each bucket cast on the trainer's device and loaded
  before the next one is made: ``begin_weight_push`` -> ``load_weight_bucket`` ... ->
  ``finish_weight_push``. vLLM (its engine core in this process: ``in_process_core``) hands each
  bucket's tensors, as they are, to its model's ``load_weights``, which copies them into its own
  parameters. A LoRA push (adapters only) is one ``load_weights`` (vLLM: the engine's adapter
  files, as in a Ray worker).
* A sharded (FSDP2) model is read one tensor at a time, gathered whole (a collective every rank enters
  in the same order); it is never shared.
* ``SyncStats.bytes`` counts the bytes copied (0 for a push shared whole).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from unirl_lightning.core.checks import require_positive
from unirl_lightning.distributed.sharding import full_tensor, is_sharded
from unirl_lightning.models.lora import is_lora_push
from unirl_lightning.weight_sync.base import (
    PushTargets,
    SyncStats,
    serving_dtype,
    tensor_bytes,
    weight_tensors,
)
from unirl_lightning.weight_sync.buckets import cast_floating, weight_buckets

__all__ = ["InProcessWeightSync"]


def _whole(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` whole (a shard gathered) and cast to ``dtype`` (floating tensors only)."""
    return full_tensor(cast_floating(tensor, dtype)) if is_sharded(tensor) else cast_floating(tensor, dtype)


class InProcessWeightSync:
    """Push by reference or by an in-memory copy to engines in the training process (``weight_sync="inprocess"``,
    the only backend of ``placement="hybrid"``); see the module docstring.

    Args:
        bucket_mb: largest bucket of a copied push (one cast bucket exists on the device at a time).

    Example::

        AsyncRolloutStrategy(placement="hybrid", weight_sync="inprocess", max_staleness=0, max_inflight=1)
    """

    def __init__(self, bucket_mb: float = 512) -> None:
        self.bucket_mb = require_positive("bucket_mb", bucket_mb)

    def push(self, model: torch.nn.Module, workers: PushTargets, weight_version: int) -> SyncStats:
        start = time.perf_counter()
        dtype = serving_dtype(model)
        tensors = weight_tensors(model)
        share = bool(getattr(workers, "share_weights", False))
        copied = 0
        for worker in workers.workers:
            engine = getattr(worker, "engine", None)
            sharded = any(is_sharded(t) for t in tensors.values())
            if share and not sharded and hasattr(engine, "share_weights"):
                copied += engine.share_weights(tensors.items(), weight_version)
            else:
                copied += self._copy(worker, tensors, dtype, weight_version)
        return SyncStats(time.perf_counter() - start, copied, len(tensors))

    def _copy(
        self, worker: Any, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None, weight_version: int
    ) -> int:
        """Stream ``tensors`` into ``worker`` bucket by bucket, each cast to ``dtype``; bytes copied."""
        if is_lora_push(list(tensors.items())):
            worker.load_weights({n: _whole(t, dtype) for n, t in tensors.items()}, weight_version)
            return tensor_bytes(tensors, dtype)
        buckets: Iterator[list[tuple[str, torch.Tensor]]] = weight_buckets(
            tensors.items(), int(self.bucket_mb * 1024**2), whole_layers=True, dtype=dtype
        )
        worker.begin_weight_push(weight_version)
        finished = False
        try:
            for bucket in buckets:
                worker.load_weight_bucket([(name, _whole(t, dtype)) for name, t in bucket])
            worker.finish_weight_push(weight_version)
            finished = True
        finally:
            if not finished:  # close what was opened; the engine keeps the version it serves
                worker.finish_weight_push(None)
        return tensor_bytes(tensors, dtype)

    def close(self) -> None:
        """Nothing is held between pushes."""
