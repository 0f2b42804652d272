"""Weight sync over a standalone ``torch.distributed`` group: trainer rank 0 broadcasts.

The group is NOT Lightning's default process group: it is built from its own ``TCPStore`` between
the trainer's rank 0 (rank 0 of this group) and every rollout worker (ranks 1..N), with gloo on
CPU and nccl on GPU. Tensors travel in dtype-homogeneous buckets of at most ``bucket_mb``, floating
ones in the model's serving dtype (cast bucket by bucket: float32 masters of a bf16 policy go as bf16). Every
collective waits at most ``timeout_s``; on expiry a ``RuntimeError`` names the step, the bucket and
the version, and the group is torn down so that the next push starts a fresh one (never a hang).
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from unirl_lightning.core.device_rules import collective_backend
from unirl_lightning.core.preflight import sync_replacement_error
from unirl_lightning.distributed.sharding import full_tensor, is_sharded
from unirl_lightning.weight_sync.base import (
    PushTargets,
    SyncStats,
    pushed_dtype,
    serving_dtype,
    tensor_bytes,
    weight_tensors,
)
from unirl_lightning.weight_sync.buckets import cast_floating, weight_buckets

Layout = list[list[tuple[str, tuple[int, ...]]]]  # buckets of (name, shape)


ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
POLL_S = 0.05  # how often a push looks at its receivers while a bucket is in flight
ABANDONED_GROUPS: list[Any] = []  # weight-sync groups dropped by close(): never destroyed on a push's path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_group(backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float):
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout  # noqa: SLF001 - torch's public Options object exposes no setter
    # torch's default (3) tears the process down when an NCCL op times out; 2 aborts the communicator
    # and raises in wait(), so a push that times out ends with this module's error. Read by the group's
    # constructor: only this group is affected, and a value the user set is kept.
    previous = os.environ.get(ASYNC_ERROR_HANDLING)
    os.environ.setdefault(ASYNC_ERROR_HANDLING, "2")
    try:
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    finally:
        if previous is None:
            os.environ.pop(ASYNC_ERROR_HANDLING, None)


def _bucket_layout(
    tensors: dict[str, torch.Tensor], bucket_bytes: int, dtype: torch.dtype | None = None
) -> tuple[Layout, list[torch.dtype]]:
    """The (name, shape) layout of each dtype-homogeneous bucket, and each bucket's dtype, for the
    tensors as they travel (floating ones cast to ``dtype``; sized on meta tensors, nothing copied)."""
    shapes = {
        name: torch.empty(tuple(t.shape), dtype=pushed_dtype(t, dtype), device="meta")
        for name, t in tensors.items()
    }
    buckets = list(weight_buckets(shapes.items(), bucket_bytes))
    layout = [[(name, tuple(t.shape)) for name, t in bucket] for bucket in buckets]
    return layout, [bucket[0][1].dtype for bucket in buckets]


def receive_device(backend: str) -> torch.device:
    """Where a worker's receive buffers live: gloo broadcasts host tensors, NCCL device tensors on the
    worker's own GPU. Inside a Ray actor the GPUs Ray assigned are the only visible ones, so that is
    ``cuda:0`` whatever ordinal the trainer's tensors have (``cuda:k`` there would be another GPU, or
    an invalid ordinal)."""
    if backend == "nccl":
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _check_replaceable(tensors: dict[str, torch.Tensor], workers: PushTargets) -> None:
    """Refuse a model sharded over several ranks when workers may be replaced
    (:func:`~unirl_lightning.core.preflight.sync_replacement_error`; the strategy's setup checks the same rule
    before any worker starts). Checked at every push too, so every rank refuses at the same point,
    before any collective."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    sharded = any(is_sharded(t) for t in tensors.values())
    error = sync_replacement_error("collective", sharded, world, workers.max_restarts)
    if error is not None:
        raise ValueError(error)


def dtype_names(dtypes: list[torch.dtype | str]) -> list[str]:
    """Bucket dtypes as strings (``torch.bfloat16`` -> ``"bfloat16"``): what crosses a msgpack RPC
    (vLLM's ``collective_rpc`` to its engine-core process) where a ``torch.dtype`` cannot."""
    return [d if isinstance(d, str) else str(d).removeprefix("torch.") for d in dtypes]


def wire_layout(layout: Layout) -> list[list[list[Any]]]:
    """``layout`` as plain lists (``[[name, [dims...]], ...]`` per bucket), msgpack-able as it is."""
    return [[[name, [int(d) for d in shape]] for name, shape in bucket] for bucket in layout]


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"not a torch dtype: {dtype!r}")
    return resolved


class CollectiveReceiver:
    """The worker's member of the weight-sync group (rank ``rank`` of ``world_size``): receives each
    bucket into a buffer on ``device`` (default :func:`receive_device`) and hands the named tensors
    to the engine.

    Held by a rollout worker between ``join_weight_group`` and ``leave_weight_group``, or, for an
    engine that is a group member of its own (vLLM), by the engine's own worker process."""

    def __init__(
        self,
        backend: str,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        device: torch.device | str | None = None,
    ) -> None:
        self.group = _make_group(backend, host, port, rank, world_size, timeout_s)
        self.device = torch.device(device) if device is not None else receive_device(backend)
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def buckets(
        self, layout: Layout | list[Any], dtypes: list[torch.dtype | str]
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Each bucket, as it arrives, as ``(name, view of its fresh flat buffer)`` pairs (shapes and
        dtypes may come as lists and strings). Lazy: bucket ``k + 1`` is received when asked for,
        so a consumer can load each bucket before the next one is allocated."""
        for bucket, dtype in zip(layout, dtypes):
            shapes = [(name, torch.Size(shape)) for name, shape in bucket]
            flat = torch.empty(sum(s.numel() for _, s in shapes), dtype=_as_dtype(dtype), device=self.device)
            self.group.broadcast([flat], dist.BroadcastOptions()).wait(self.timeout)
            named: list[tuple[str, torch.Tensor]] = []
            offset = 0
            for name, shape in shapes:
                n = int(shape.numel())
                named.append((name, flat[offset : offset + n].view(shape)))
                offset += n
            yield named

    def receive(
        self, layout: Layout | list[Any], dtypes: list[torch.dtype | str]
    ) -> list[tuple[str, torch.Tensor]]:
        """Every bucket of the push, as one list of named tensors."""
        return [item for bucket in self.buckets(layout, dtypes) for item in bucket]


SINGLE_RANK_TIMEOUT_S = 120.0
"""A push's deadline with one training rank (nothing else can hold the trainer up)."""


class CollectiveWeightSync:
    """Broadcast weights from the trainer to every worker over a dedicated process group.

    Args:
        bucket_mb: the size of one broadcast (the push's peak device memory beyond the model).
        timeout_s: the one deadline of every wait of a push, the workers' receive included. None =
            with several training ranks the training process group's ``timeout_s`` (a worker starts
            its receive when its rank asks, and the rank's broadcast can wait behind collectives of
            every rank, so both sides wait as long as the ranks wait for each other); with one rank
            :data:`SINGLE_RANK_TIMEOUT_S`.
        backend: ``"nccl"`` (CUDA), ``"gloo"``, or ``"auto"``: NCCL when the trainer is on CUDA and every
            worker's actor holds a GPU, else gloo (:func:`~unirl_lightning.core.device_rules.collective_backend`).

    Example::

        AsyncRolloutStrategy(weight_sync=CollectiveWeightSync(bucket_mb=256, timeout_s=120))
    """

    def __init__(self, bucket_mb: float = 128, timeout_s: float | None = None, backend: str = "auto") -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be one of ('auto', 'gloo', 'nccl'), got {backend!r}")
        self.bucket_bytes = int(bucket_mb * 1024**2)
        self.timeout_given = timeout_s is not None
        self.timeout_s = float(timeout_s) if timeout_s is not None else SINGLE_RANK_TIMEOUT_S
        self.backend = backend
        self.actor_gpus: float = 1.0  # what each worker's actor holds; the strategy sets it at setup
        self._group = None
        self._workers_key: tuple[Any, ...] | None = None

    def follow_process_group(self, timeout_s: float) -> None:
        """Wait as long as the training process group does (the strategy calls this at setup with
        several ranks), unless ``timeout_s`` was given."""
        if not self.timeout_given:
            self.timeout_s = float(timeout_s)

    def for_workers(self, actor_gpus: float) -> None:
        """The GPUs each worker's actor process holds (``num_gpus_per_worker`` under the actor layout,
        0 under ``per_gpu`` or for CPU workers): ``"auto"`` picks NCCL only when both ends hold a GPU."""
        self.actor_gpus = float(actor_gpus)

    def resolved_backend(self, device: torch.device) -> str:
        """The backend a push from the trainer's ``device`` uses."""
        return collective_backend(self.backend, device.type, self.actor_gpus)

    def _connect(self, workers: PushTargets, device: torch.device) -> None:
        import ray

        backend = self.resolved_backend(device)
        host, port = "127.0.0.1", _free_port()
        if len(ray.nodes()) > 1:  # a real cluster: workers dial this node's address
            host = ray.util.get_node_ip_address()
        world_size = len(workers.workers) + 1
        joins = [
            w.join_weight_group.remote(backend, host, port, i + 1, world_size, self.timeout_s)
            for i, w in enumerate(workers.workers)
        ]
        self._group = _make_group(backend, host, port, 0, world_size, self.timeout_s)
        self._get(joins, "joining the weight-sync group")
        self._workers_key = tuple(workers.workers)
        self._send_device = device if backend == "nccl" else torch.device("cpu")

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        import ray

        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            self._abandon()
            raise RuntimeError(
                f"collective weight sync: workers did not finish {what} within {self.timeout_s}s"
            ) from exc

    def push(self, model: torch.nn.Module, workers: PushTargets, weight_version: int) -> SyncStats:
        start = time.perf_counter()
        # as the trainer holds them: a sharded model is gathered bucket by bucket below, never whole
        tensors = weight_tensors(model)
        _check_replaceable(tensors, workers)
        device = next(iter(tensors.values())).device
        if self._group is None or self._workers_key != tuple(workers.workers):
            self._connect(workers, device)
        dtype = serving_dtype(model)  # float32 masters of a bf16 policy travel as bf16
        layout, dtypes = _bucket_layout(tensors, self.bucket_bytes, dtype)
        receive = [w.receive_weights.remote(layout, dtypes, weight_version) for w in workers.workers]
        timeout = datetime.timedelta(seconds=self.timeout_s)
        for index, bucket in enumerate(layout):
            # cast bucket by bucket, each shard before its gather
            flat = torch.cat(
                [full_tensor(cast_floating(tensors[name], dtype)).reshape(-1) for name, _ in bucket]
            )
            flat = flat.to(self._send_device)  # NCCL sends from the trainer's GPU, gloo from the host
            where = f"bucket {index + 1}/{len(layout)} of weight_version {weight_version}"
            try:
                work = self._group.broadcast([flat], dist.BroadcastOptions())
                self._watch(work, receive, last=index == len(layout) - 1)
                work.wait(timeout)
            except RuntimeError as exc:
                self._abandon()
                raise RuntimeError(
                    f"collective weight sync failed or timed out ({self.timeout_s}s) on {where}: {exc}"
                ) from exc
        self._get(receive, f"loading weight_version {weight_version}")
        return SyncStats(time.perf_counter() - start, tensor_bytes(tensors, dtype), len(tensors))

    def _watch(self, work: Any, receive: list[Any], last: bool) -> None:
        """Wait for one bucket's broadcast while watching the receivers: a receiver that ended before
        the last bucket (it failed, or its worker died, before or while receiving) ends the push now
        with its error, instead of after the broadcast's timeout (or NCCL's, which takes the process)."""
        import ray

        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed() and time.monotonic() < deadline:
            ended, _ = ray.wait(receive, num_returns=1, timeout=POLL_S)
            if ended:
                try:
                    ray.get(ended)
                except Exception as exc:  # noqa: BLE001 - the receiver's own error, whatever it is
                    raise RuntimeError(f"a worker's receive ended before the push did: {exc}") from exc
                if not last:  # a receive that returned during the last bucket is one that is done
                    raise RuntimeError("a worker's receive ended before the push did, without an error")
                return

    def close(self) -> None:
        self._group = None
        self._workers_key = None

    def _abandon(self) -> None:
        """Drop the group after a failed push. It may still have a bucket in flight (a push that failed): its
        destructor would wait for that operation's own timeout, holding the interpreter, so the group
        is kept (``ABANDONED_GROUPS``) instead of destroyed; an NCCL group is also aborted, on a daemon
        thread, which frees its communicator and the operation (what torch's own watchdog does)."""
        group, self._group = self._group, None
        self._workers_key = None
        if group is None:
            return
        ABANDONED_GROUPS.append(group)
        if type(group).__name__ == "ProcessGroupNCCL":

            def abort(group: Any = group) -> None:
                try:
                    group.abort()
                except (AttributeError, RuntimeError):
                    pass

            threading.Thread(target=abort, name="unirl-weight-group-abort", daemon=True).start()
