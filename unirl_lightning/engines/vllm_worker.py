"""Code that runs inside vLLM's own worker process (or in-process, with the engine core in the worker).

:class:`VLLMWorkerExtension` is mixed into vLLM's worker class (``worker_extension_cls``); the
engine (:mod:`unirl_lightning.engines.vllm`) calls its methods through ``LLM.collective_rpc`` by name,
so the same code runs in-process and in vLLM's engine-core process. A bucket crosses to that
process packed (:func:`~unirl_lightning.weight_sync.buckets.pack_tensors` as bytes): vLLM's msgpack RPC does not rebuild tensors nested in call
arguments. Imports vLLM only inside the methods, which run where vLLM is loaded.
"""

from __future__ import annotations

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
