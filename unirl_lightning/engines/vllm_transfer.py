"""vLLM's own weight-transfer lifecycle, with this library's transports as its backend (``"unirl"``).

vLLM (0.32) updates weights in sessions: ``init_weight_transfer_engine`` once (join the trainer's
group), then per push ``start_weight_update`` -> ``update_weights`` (one chunk at a time) ->
``finish_weight_update``. Its worker runs each step on a ``WeightTransferEngine`` that the backend
named in ``weight_transfer_config`` provides, keeps the session's state (a chunk outside a session is
refused) and resets the LoRA state when a session ends. vLLM's own backends are GPU transports (NCCL,
CUDA IPC, NIXL); this one carries what the engine pushes today, so the same calls run on vLLM-CPU and
on a GPU:

* a packed bucket (``{"bucket": ...}``: :func:`~unirl_lightning.weight_sync.buckets.pack_tensors` as
  bytes, or the ``(name, tensor)`` list when the engine core runs in this process), loaded with the
  model's ``load_weights``;
* the collective backend's broadcast (``{"layout": ..., "dtype_names": ...}``): the worker joined the
  trainer's weight-sync group at ``init_weight_transfer_engine`` (``{"group": {...}}``) and receives
  each bucket in place on its own device before loading it.

``reload`` (``init_info``; the engine's ``weight_update: reload``) runs vLLM's layerwise reload around
the session (``start``: ``initialize_layerwise_reload``; ``finish``: ``finalize_layerwise_reload``),
so kernels that repack weights after loading see them whole. A chunk that fails finalizes the reload
before the error propagates (vLLM ends the session there without calling ``finish``), so every layer
is put back. Runs where vLLM is loaded: the worker extension (:mod:`~unirl_lightning.engines.vllm_worker`)
registers the backend when vLLM imports it into its worker process, before the model loads.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import torch

from unirl_lightning.weight_sync.buckets import unpack_tensors

__all__ = ["BACKEND", "UnirlTransfer", "engine_class", "register"]

BACKEND = "unirl"


@dataclass
class UnirlInitInfo:
    """``reload``: run vLLM's layerwise reload around each session; ``group``: join the trainer's
    weight-sync group (``backend``, ``host``, ``port``, ``rank``, ``world_size``, ``timeout_s``)."""

    reload: bool = True
    group: dict[str, Any] | None = None


@dataclass
class UnirlUpdateInfo:
    """One chunk: a packed ``bucket``, or a broadcast's ``layout`` and ``dtype_names`` (``digests``:
    record a sha256 of each received tensor, a test's check)."""

    bucket: Any = None
    layout: list[Any] | None = None
    dtype_names: list[str] | None = None
    digests: bool = False


class UnirlTransfer:
    """The ``"unirl"`` backend's methods (module docstring), combined with vLLM's
    ``WeightTransferEngine`` by :func:`engine_class` (so this module imports without vLLM).
    ``last_receive`` holds the last broadcast's receiving pid per bucket, tensor count and digests
    (read with ``unirl_transfer_state``)."""

    init_info_cls = UnirlInitInfo
    update_info_cls = UnirlUpdateInfo
    supports_draft_weight_update = False

    device: torch.device
    model: Any
    model_config: Any

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.reload = True
        self.reloading = False
        self.receiver: Any = None
        self.last_receive: dict[str, Any] = {}

    def init_transfer_engine(self, init_info: UnirlInitInfo) -> None:
        self.reload = bool(init_info.reload)
        if init_info.group is not None:
            from unirl_lightning.weight_sync.collective import CollectiveReceiver, receive_device

            group = dict(init_info.group)
            backend = str(group.pop("backend"))
            device = self.device if backend == "nccl" else receive_device(backend)
            self.receiver = CollectiveReceiver(backend, device=device, **group)

    def start_weight_update(self) -> None:
        if self.reload:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)
            self.reloading = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """One chunk; a failure finalizes the layerwise reload first (vLLM's worker ends the session
        without calling :meth:`finish_weight_update`). The device is synchronized only where there is
        an accelerator (``torch.accelerator.synchronize`` raises on a CPU-only build)."""
        try:
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type != "cpu":
                torch.accelerator.synchronize()
        except BaseException:
            self.finish_weight_update()
            raise

    def receive_weights(self, update_info: UnirlUpdateInfo) -> None:
        if update_info.layout is not None:
            self._receive_broadcast(update_info)
            return
        bucket = update_info.bucket
        named = unpack_tensors(bucket) if isinstance(bucket, dict) else list(bucket or ())
        self.model.load_weights(weights=((name, t.to(self.device)) for name, t in named))

    def _receive_broadcast(self, update_info: UnirlUpdateInfo) -> None:
        if self.receiver is None:
            raise RuntimeError(
                "vLLM worker: a broadcast push before init_weight_transfer_engine joined the weight-sync group"
            )
        pids: list[int] = []
        digests: dict[str, str] = {}
        count = 0
        for bucket in self.receiver.buckets(update_info.layout, update_info.dtype_names):
            pids.append(os.getpid())
            if update_info.digests:
                digests.update((name, digest(t)) for name, t in bucket)
            self.model.load_weights(weights=iter(bucket))
            count += len(bucket)
        self.last_receive = {"pids": pids, "tensors": count, "digests": digests}

    def finish_weight_update(self) -> None:
        if self.reloading:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self.reloading = False
            finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.receiver = None


def digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (copied to the host)."""
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


def engine_class() -> type:
    """The backend's class: :class:`UnirlTransfer` on vLLM's ``WeightTransferEngine`` (imports vLLM)."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return type("UnirlWeightTransferEngine", (UnirlTransfer, WeightTransferEngine), {"__module__": __name__})


def register() -> None:
    """Register the backend with vLLM's factory (once per process; imports vLLM)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, engine_class())
    except ValueError:  # already registered in this process
        pass
