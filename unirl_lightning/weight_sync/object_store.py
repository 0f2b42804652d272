"""Default weight sync: the CPU weights through Ray's object store (:class:`PackedWeights`), every
worker loads them.

Floating tensors travel in the model's serving dtype (:func:`~unirl_lightning.weight_sync.base.serving_dtype`:
bf16 for a bf16 policy trained on float32 masters), cast one tensor at a time.

A push is streamed in buckets of at most ``bucket_mb`` (a decoder layer is never split): one
``ray.put`` per bucket, each worker loads each bucket as it arrives, and a bucket leaves the store
once every worker loaded it, so the store holds about two buckets of a push at a time, whatever the
model's size (a 7B bf16 push is ~15 GB, the default local store 4 GiB). A sharded (FSDP2) model is
gathered a bucket at a time too (a collective every training rank enters in the same order). The
engine serves the new version only after the last bucket (``begin_weight_push`` ->
``load_weight_bucket`` ... -> ``finish_weight_push``); a push of one bucket (a LoRA adapter push is
always one, a small model) is a single ``load_weights``.

The last push stays in the object store until the next one when it is small enough
(``keep_last_mb``), so a replaced worker gets it again (:meth:`ObjectStoreWeightSync.resend`): no
gather, no new copy. Under FSDP that is what keeps a replacement from entering a gather the other
ranks are not in; a larger push is not kept, and then a replacement gets a fresh push on a single
device or under DDP, and under FSDP the runtime refuses the replacement with an error naming the fix.
"""

from __future__ import annotations

import time
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
from unirl_lightning.weight_sync.buckets import PackedWeights, cast_floating, weight_buckets


class ObjectStoreWeightSync:
    """Push through Ray's object store: simple, works across nodes, one copy per node.

    Args:
        timeout_s: how long every worker may take to load a push; then a ``TimeoutError`` names
            the version.
        bucket_mb: largest bucket of a push (one object in the store at a time besides the one
            being loaded; a decoder layer larger than that is a bucket alone).
        keep_last_mb: the last push is kept for :meth:`resend` when it is at most this size (it then
            holds that much of the object store until the next push). None = a quarter of this
            node's object store.

    Example::

        AsyncRolloutStrategy(weight_sync=ObjectStoreWeightSync(timeout_s=300, bucket_mb=512))
    """

    def __init__(
        self, timeout_s: float = 600.0, bucket_mb: float = 512, keep_last_mb: float | None = None
    ) -> None:
        self.timeout_s = require_positive("timeout_s", timeout_s)
        self.bucket_mb = require_positive("bucket_mb", bucket_mb)
        self.keep_last_mb = None if keep_last_mb is None else float(keep_last_mb)
        # (bucket refs, weight_version, stats) of the last push, when it was kept
        self._last: tuple[list[Any], int, SyncStats] | None = None

    def push(self, model: torch.nn.Module, workers: PushTargets, weight_version: int) -> SyncStats:
        start = time.perf_counter()
        dtype = serving_dtype(model)  # float32 masters of a bf16 policy travel as bf16
        tensors = weight_tensors(model)  # as held: shards are gathered a bucket at a time below
        self._last = None  # release the previous push before the next one is put
        nbytes = tensor_bytes(tensors, dtype)
        keep = nbytes <= self._keep_limit()
        if is_lora_push(list(tensors.items())):  # adapters are small: one bucket
            buckets = [list(tensors.items())]
        else:
            buckets = weight_buckets(
                tensors.items(), int(self.bucket_mb * 1024**2), whole_layers=True, dtype=dtype
            )
        refs = self._stream((_pack(bucket, dtype) for bucket in buckets), workers, weight_version, keep)
        stats = SyncStats(time.perf_counter() - start, nbytes, len(tensors))
        if keep:
            self._last = (refs, weight_version, stats)
        return stats

    def resend(self, workers: PushTargets, weight_version: int) -> SyncStats | None:
        """Load the last push into ``workers`` (e.g. a replaced worker) when it was of
        ``weight_version`` and was kept (``keep_last_mb``): no gather (no collective), no new copy.
        None when there is no such push (nothing pushed yet, the last push was of another version,
        or too large to keep)."""
        if self._last is None or self._last[1] != weight_version:
            return None
        refs, _, pushed = self._last
        start = time.perf_counter()
        self._stream(iter(refs), workers, weight_version, keep=True)
        return SyncStats(time.perf_counter() - start, pushed.bytes, pushed.num_tensors)

    def _keep_limit(self) -> float:
        import ray

        if self.keep_last_mb is not None:
            return self.keep_last_mb * 1024**2
        node = ray.get_runtime_context().get_node_id()
        store = next(
            (n["Resources"].get("object_store_memory", 0) for n in ray.nodes() if n["NodeID"] == node), 0
        )
        return store / 4

    def _stream(self, buckets: Any, workers: PushTargets, weight_version: int, keep: bool) -> list[Any]:
        """Put each bucket (or take each ref) and have every worker load it; a bucket is put while
        the workers load the one before, and released once they did (unless ``keep``). One bucket:
        one ``load_weights``. Returns the refs kept."""
        import ray

        deadline = time.monotonic() + self.timeout_s
        head = [next(buckets)]
        second = next(buckets, None)
        if second is None:  # the whole push in one object
            ref = _put(head.pop())
            self._wait(
                [w.load_weights.remote(ref, weight_version) for w in workers.workers],
                deadline,
                weight_version,
            )
            return [ref]
        head.append(second)
        del second
        kept: list[Any] = []
        begun = [w.begin_weight_push.remote(weight_version) for w in workers.workers]
        finished = False
        try:
            self._wait(begun, deadline, weight_version)
            pending: tuple[Any, list[Any]] | None = None
            for bucket in _chain(head, buckets):
                ref = _put(bucket)
                del bucket
                loads = [w.load_weight_bucket.remote(ref) for w in workers.workers]
                if keep:
                    kept.append(ref)
                if pending is not None:  # the previous bucket leaves the store once every worker loaded it
                    self._wait(pending[1], deadline, weight_version)
                pending = (ref, loads)
                del ref
            if pending is not None:
                self._wait(pending[1], deadline, weight_version)
            pending = None
            self._wait(
                [w.finish_weight_push.remote(weight_version) for w in workers.workers],
                deadline,
                weight_version,
            )
            finished = True
        finally:
            if not finished:  # close what the workers opened; they keep the version they serve
                aborted = [w.finish_weight_push.remote(None) for w in workers.workers]
                ray.wait(aborted, num_returns=len(aborted), timeout=60)
        return kept

    def _wait(self, futures: list[Any], deadline: float, weight_version: int) -> None:
        import ray

        try:
            ray.get(futures, timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(
                f"rollout workers did not load weight_version {weight_version} within timeout_s={self.timeout_s} s"
            ) from exc

    def close(self) -> None:
        self._last = None  # the kept push leaves the object store


def _chain(head: list[Any], rest: Any) -> Any:
    """The buckets of ``head`` (taken out of it, so none stays referenced), then those of ``rest``."""
    while head:
        yield head.pop(0)
    yield from rest


def _put(bucket: Any) -> Any:
    import ray

    return bucket if isinstance(bucket, ray.ObjectRef) else ray.put(bucket)


def _pack(bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> PackedWeights:
    """One bucket, its sharded tensors gathered whole (cast first, so the gather moves the serving
    dtype) and moved to the host one at a time, every floating tensor in ``dtype``."""
    return PackedWeights.pack(
        ((name, full_tensor(cast_floating(t, dtype)).cpu() if is_sharded(t) else t) for name, t in bucket),
        dtype,
    )
