"""Weight sync over a standalone ``torch.distributed`` group: trainer rank 0 broadcasts.

The group is NOT Lightning's default process group: it is built from its own ``TCPStore`` between
the trainer's rank 0 (rank 0 of this group) and every rollout worker (ranks 1..N), with gloo on
CPU and nccl on GPU. Tensors travel in dtype-homogeneous buckets of at most ``bucket_mb``. Every
collective waits at most ``timeout_s``; on expiry a ``RuntimeError`` names the step, the bucket and
the version, and the group is torn down so that the next push starts a fresh one (never a hang).
"""

from __future__ import annotations

import datetime
import socket
import time
from typing import Any

import ray
import torch
import torch.distributed as dist

from unirl_lightning.sharding import full_tensor
from unirl_lightning.weight_sync.base import SyncStats, tensor_bytes, weight_tensors
from unirl_lightning.weight_sync.buckets import weight_buckets

Layout = list[list[tuple[str, tuple[int, ...]]]]  # buckets of (name, shape)


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
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def _bucket_layout(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> tuple[Layout, list[torch.dtype]]:
    """The (name, shape) layout of each dtype-homogeneous bucket, and each bucket's dtype."""
    buckets = list(weight_buckets(tensors.items(), bucket_bytes))
    layout = [[(name, tuple(t.shape)) for name, t in bucket] for bucket in buckets]
    return layout, [bucket[0][1].dtype for bucket in buckets]


# --- worker side (run inside the rollout worker through RolloutWorker.run) -----------------------
def _worker_join(
    worker: Any, backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float
):
    worker.collective_group = _make_group(backend, host, port, rank, world_size, timeout_s)
    worker.collective_timeout_s = timeout_s
    return rank


def _worker_receive(worker: Any, layout: Layout, dtypes: list[torch.dtype], weight_version: int, device: str):
    group = worker.collective_group
    timeout = datetime.timedelta(seconds=worker.collective_timeout_s)
    named: list[tuple[str, torch.Tensor]] = []
    for bucket, dtype in zip(layout, dtypes):
        numel = sum(int(torch.Size(shape).numel()) for _, shape in bucket)
        flat = torch.empty(numel, dtype=dtype, device=device)
        group.broadcast([flat], dist.BroadcastOptions()).wait(timeout)
        offset = 0
        for name, shape in bucket:
            n = int(torch.Size(shape).numel())
            named.append((name, flat[offset : offset + n].view(shape)))
            offset += n
    worker.engine.load_weights(named, weight_version)
    return weight_version


def _worker_leave(worker: Any) -> None:
    worker.collective_group = None


class CollectiveWeightSync:
    """Broadcast weights from the trainer to every worker over a dedicated process group.

    Example::

        AsyncRolloutStrategy(weight_sync=CollectiveWeightSync(bucket_mb=256, timeout_s=120))
    """

    def __init__(self, bucket_mb: float = 128, timeout_s: float = 120.0, backend: str = "auto") -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be one of ('auto', 'gloo', 'nccl'), got {backend!r}")
        self.bucket_bytes = int(bucket_mb * 1024**2)
        self.timeout_s = timeout_s
        self.backend = backend
        self._group = None
        self._workers_key: tuple[Any, ...] | None = None

    def _connect(self, workers: Any, device: torch.device) -> None:
        backend = self.backend if self.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        host, port = "127.0.0.1", _free_port()
        if len(ray.nodes()) > 1:  # a real cluster: workers dial this node's address
            host = ray.util.get_node_ip_address()
        world_size = len(workers.workers) + 1
        joins = [
            w.run.remote(_worker_join, backend, host, port, i + 1, world_size, self.timeout_s)
            for i, w in enumerate(workers.workers)
        ]
        self._group = _make_group(backend, host, port, 0, world_size, self.timeout_s)
        self._get(joins, "joining the weight-sync group")
        self._workers_key = tuple(workers.workers)
        self._device = device

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            self.close()
            raise RuntimeError(
                f"collective weight sync: workers did not finish {what} within {self.timeout_s}s"
            ) from exc

    def push(self, model: torch.nn.Module, workers: Any, weight_version: int) -> SyncStats:
        start = time.perf_counter()
        # as the trainer holds them: a sharded model is gathered bucket by bucket below, never whole
        tensors = weight_tensors(model)
        device = next(iter(tensors.values())).device
        if self._group is None or self._workers_key != tuple(workers.workers):
            self._connect(workers, device)
        layout, dtypes = _bucket_layout(tensors, self.bucket_bytes)
        receive = [
            w.run.remote(_worker_receive, layout, dtypes, weight_version, str(device))
            for w in workers.workers
        ]
        timeout = datetime.timedelta(seconds=self.timeout_s)
        for index, bucket in enumerate(layout):
            flat = torch.cat([full_tensor(tensors[name]).reshape(-1) for name, _ in bucket])
            try:
                self._group.broadcast([flat], dist.BroadcastOptions()).wait(timeout)
            except RuntimeError as exc:
                self.close()
                raise RuntimeError(
                    f"collective weight sync failed or timed out ({self.timeout_s}s) on bucket {index + 1}/"
                    f"{len(layout)} of weight_version {weight_version}: {exc}"
                ) from exc
        self._get(receive, f"loading weight_version {weight_version}")
        return SyncStats(time.perf_counter() - start, tensor_bytes(tensors), len(tensors))

    def close(self) -> None:
        self._group = None
        self._workers_key = None
