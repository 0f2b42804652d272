"""A collective push whose receiver fails ends within the rollout's own deadline, with the receiver's
error: the trainer watches the receive refs (``ray.wait``) while each bucket is in flight, instead of
learning of the failure from the broadcast's timeout (under NCCL, torch's default then takes the process
down). Over gloo, with buckets larger than a socket's buffer so that the trainer's send blocks on the
missing receiver, as NCCL's broadcast does."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from unirl_lightning.weight_sync import CollectiveWeightSync
from unirl_lightning.weight_sync.collective import ASYNC_ERROR_HANDLING, CollectiveReceiver, _make_group

TIMEOUT_S = 40.0


def receiver_class(ray):
    @ray.remote(num_cpus=0)
    class Receiver:
        """A worker's side of the group that joins, then fails before its first bucket (an engine that
        refuses the push, or a worker that dies)."""

        def join_weight_group(self, backend, host, port, rank, world_size, timeout_s):
            self.receiver = CollectiveReceiver(backend, host, port, rank, world_size, timeout_s)

        def receive_weights(self, layout, dtypes, weight_version):
            raise ValueError(f"engine refused weight_version {weight_version}")

    return Receiver


@pytest.mark.slow
def test_a_receiver_that_fails_before_the_broadcast_ends_the_push_at_once(ray_local):
    receiver = receiver_class(ray_local).remote()
    workers = SimpleNamespace(workers=[receiver], max_restarts=0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)])  # 16 MB
    sync = CollectiveWeightSync(bucket_mb=4, timeout_s=TIMEOUT_S, backend="gloo")
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="engine refused weight_version 1"):
        sync.push(model, workers, weight_version=1)
    took = time.monotonic() - began
    assert took < TIMEOUT_S / 4, f"the push took {took:.1f} s: it waited for the broadcast's timeout"
    assert sync._group is None  # closed: the next push connects afresh
    ray_local.kill(receiver)


def test_an_nccl_group_is_built_to_raise_rather_than_end_the_process(monkeypatch):
    """torch's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` tears the process down on an NCCL timeout;
    the weight-sync group is built with 2 (abort the communicator, raise in ``wait``), for itself alone,
    and a value the user set is kept. No NCCL here: the constructor is replaced by a recorder."""
    seen = []
    monkeypatch.delenv(ASYNC_ERROR_HANDLING, raising=False)
    monkeypatch.setattr(torch.distributed, "ProcessGroupNCCL", FakeNCCL.recording(seen), raising=False)
    _make_group("nccl", "127.0.0.1", free_port(), 0, 1, 5.0)
    assert seen == ["2"]
    import os

    assert ASYNC_ERROR_HANDLING not in os.environ  # only the group's construction saw it
    monkeypatch.setenv(ASYNC_ERROR_HANDLING, "1")
    _make_group("nccl", "127.0.0.1", free_port(), 0, 1, 5.0)
    assert seen == ["2", "1"]


class FakeNCCL:
    Options = SimpleNamespace

    @classmethod
    def recording(cls, seen: list):
        import os

        class Recorder(cls):
            def __init__(self, *args):
                seen.append(os.environ.get(ASYNC_ERROR_HANDLING))

        return Recorder


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
