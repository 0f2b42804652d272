"""Code that runs inside vLLM's own worker process (or in-process, with the engine core in the worker).

:class:`VLLMWorkerExtension` is mixed into vLLM's worker class (``worker_extension_cls``); the
engine (:mod:`unirl_lightning.engines.vllm`) calls its methods through ``LLM.collective_rpc`` by name,
so the same code runs in-process and in vLLM's engine-core process. A bucket crosses to that
process packed (:func:`pack_bucket`): vLLM's msgpack RPC does not rebuild tensors nested in call
arguments. Imports vLLM only inside the methods, which run where vLLM is loaded.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["VLLMWorkerExtension", "pack_bucket", "unpack_bucket"]


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

        named_tensors = unpack_bucket(bucket) if isinstance(bucket, dict) else bucket
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


def pack_bucket(bucket: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """A bucket as names, dtypes, shapes and one byte string: what survives vLLM's msgpack RPC to its
    engine-core process (which does not rebuild tensors nested in call arguments)."""
    flat = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
    return {
        "names": [name for name, _ in bucket],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "data": torch.cat(flat).numpy().tobytes() if flat else b"",
    }


def unpack_bucket(packed: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    data = torch.frombuffer(bytearray(packed["data"]), dtype=torch.uint8) if packed["data"] else None
    named: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for name, dtype_name, shape in zip(packed["names"], packed["dtypes"], packed["shapes"]):
        dtype = getattr(torch, dtype_name)
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        # clone: a fresh, aligned storage for the dtype view
        named.append((name, data[offset : offset + nbytes].clone().view(dtype).reshape(shape)))
        offset += nbytes
    return named
