"""Code that runs inside vLLM's own worker process (or in-process, with the engine core in the worker).

:class:`VLLMWorkerExtension` is mixed into vLLM's worker class (``worker_extension_cls``); the
engine (:mod:`unirl_lightning.engines.vllm`) calls its methods through ``LLM.collective_rpc`` by name,
so the same code runs in-process and in vLLM's engine-core process. A bucket crosses to that
process packed (:func:`~unirl_lightning.weight_sync.buckets.pack_tensors` as bytes): vLLM's msgpack RPC does not rebuild tensors nested in call
arguments.

Under the collective weight-sync backend the member of the weight-update group is this code, in
vLLM's worker process: ``unirl_join_weight_group`` builds a
:class:`~unirl_lightning.weight_sync.collective.CollectiveReceiver` there, with its buffers on the
worker's own device (the model runner's GPU for NCCL, the host for gloo), and
``unirl_receive_weights`` receives each bucket of the trainer's broadcast in place and loads it
with the model's ``load_weights`` before the next one arrives. Only control messages cross
``collective_rpc`` (addresses, the layout as names and lists of dims, dtypes as strings); no tensor
is copied to the host or serialized. Imports vLLM only inside the methods, which run where vLLM
is loaded.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

from unirl_lightning.weight_sync.buckets import unpack_tensors

__all__ = ["VLLMWorkerExtension"]


class VLLMWorkerExtension:
    """Weight-update methods mixed into vLLM's worker class (``worker_extension_cls``).

    ``self`` is vLLM's worker; the engine calls these through ``LLM.collective_rpc`` by name, so the
    same code runs in-process and in vLLM's engine-core process. Method names carry a ``unirl_``
    prefix so they cannot clash with the worker's own.
    """

    def unirl_begin_weight_update(self, reload: bool) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.unirl_reload = reload
        if reload:
            with set_current_vllm_config(self.vllm_config):
                initialize_layerwise_reload(self.model_runner.get_model())

    def unirl_load_weight_bucket(self, bucket: list[tuple[str, torch.Tensor]] | dict[str, Any]) -> int:
        from vllm.config import set_current_vllm_config

        named_tensors = unpack_tensors(bucket) if isinstance(bucket, dict) else bucket
        model = self.model_runner.get_model()
        device = self.model_runner.device
        with set_current_vllm_config(self.vllm_config):
            model.load_weights(weights=((name, t.to(device)) for name, t in named_tensors))
        return len(named_tensors)

    def unirl_finish_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if getattr(self, "unirl_reload", False):
            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(self.model_runner.get_model(), self.model_runner.model_config)
        self.unirl_reload = False
        self.model_runner.reset_lora_state()  # adapters were computed against the old base weights

    # -- the collective backend: this process is the weight-sync group's member -----------------
    def unirl_join_weight_group(
        self, backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float
    ) -> int:
        """Join the trainer's weight-sync group as ``rank``; returns this process's pid."""
        from unirl_lightning.weight_sync.collective import CollectiveReceiver, receive_device

        device = self.model_runner.device if backend == "nccl" else receive_device(backend)
        self.unirl_receiver = CollectiveReceiver(
            backend, host, port, rank, world_size, timeout_s, device=device
        )
        return os.getpid()

    def unirl_receive_weights(
        self, layout: list[Any], dtype_names: list[str], digests: bool = False
    ) -> dict[str, Any]:
        """Receive one push (buckets of ``[name, [dims...]]`` in ``dtype_names``) and load each bucket
        into the model as it arrives; call between ``unirl_begin_weight_update`` and
        ``unirl_finish_weight_update``. Returns ``{"pids": [the receiving pid per bucket], "tensors":
        count, "digests": {name: sha256 of the received bytes}}`` (digests only if asked: a test's
        check, which copies each tensor to the host)."""
        from vllm.config import set_current_vllm_config

        receiver = getattr(self, "unirl_receiver", None)
        if receiver is None:
            raise RuntimeError("vLLM worker: unirl_receive_weights before unirl_join_weight_group")
        model = self.model_runner.get_model()
        pids: list[int] = []
        received: dict[str, str] = {}
        count = 0
        with set_current_vllm_config(self.vllm_config):
            for bucket in receiver.buckets(layout, dtype_names):
                pids.append(os.getpid())
                if digests:
                    received.update((name, _digest(t)) for name, t in bucket)
                model.load_weights(weights=iter(bucket))
                count += len(bucket)
        self.unirl_receive_pids = pids
        return {"pids": pids, "tensors": count, "digests": received}

    def unirl_leave_weight_group(self) -> None:
        self.unirl_receiver = None

    def unirl_param_digests(self, shapes: dict[str, list[int]] | None = None) -> dict[str, Any]:
        """sha256 of the bytes, dtype and shape of each of the model's parameters as vLLM holds them
        (a test's check of what a push left in the model). ``shapes`` digests only the leading
        ``shape`` block of the named parameters (vLLM pads an embedding's rows to a multiple of 64)."""
        model = self.model_runner.get_model()
        params = dict(model.named_parameters())
        if shapes is not None:
            params = {
                name: params[name][tuple(slice(0, int(n)) for n in shape)]
                for name, shape in shapes.items()
                if name in params
            }
        return {
            name: [_digest(p), str(p.dtype).removeprefix("torch."), list(p.shape)]
            for name, p in params.items()
        }


def _digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()
