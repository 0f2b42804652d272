"""Code that runs inside vLLM's own worker process (or in-process, with the engine core in the worker).

:class:`VLLMWorkerExtension` is mixed into vLLM's worker class (``worker_extension_cls``); the
engine (:mod:`unirl_lightning.engines.vllm`) calls its methods through ``collective_rpc`` by name, so
the same code runs in-process and in vLLM's engine-core process. Importing this module where vLLM is
installed registers the ``"unirl"`` weight-transfer backend (:mod:`~unirl_lightning.engines.vllm_transfer`)
with vLLM's factory: vLLM imports the extension into its worker before the model loads, so the
backend named in ``weight_transfer_config`` exists when the worker builds it. Pushes then go through
vLLM's own session calls (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``); this extension adds only what those calls do not
return: the backend's state (the receiving pid, the last broadcast's pids, count and digests) and a
digest of the model's parameters (a test's check of what a push left in the model).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

__all__ = ["VLLMWorkerExtension"]

if importlib.util.find_spec("vllm") is not None:  # vLLM's worker (or the engine's own process)
    from unirl_lightning.engines import vllm_transfer

    vllm_transfer.register()


class VLLMWorkerExtension:
    """Methods mixed into vLLM's worker class (``worker_extension_cls``).

    ``self`` is vLLM's worker; the engine calls these through ``collective_rpc`` by name. Method names
    carry a ``unirl_`` prefix so they cannot clash with the worker's own.
    """

    def unirl_transfer_state(self) -> dict[str, Any]:
        """``{"pid", "last_receive"}``: this process's pid, and the weight-transfer backend's last
        broadcast (receiving pid per bucket, tensor count, digests when asked)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return {"pid": os.getpid(), "last_receive": dict(getattr(engine, "last_receive", {}) or {})}

    def unirl_end_open_session(self) -> bool:
        """End this worker's weight-update session if it is still open (after a chunk failed on another
        tensor-parallel worker: vLLM ends the session only where the chunk raised); True if it was."""
        if not getattr(self, "_weight_update_active", False):
            return False
        self.finish_weight_update()
        return True

    def unirl_param_digests(self, shapes: dict[str, list[int]] | None = None) -> dict[str, Any]:
        """sha256 of the bytes, dtype and shape of each of the model's parameters as vLLM holds them
        (a test's check of what a push left in the model). ``shapes`` digests only the leading
        ``shape`` block of the named parameters (vLLM pads an embedding's rows to a multiple of 64)."""
        from unirl_lightning.engines.vllm_transfer import digest

        model = self.model_runner.get_model()
        params = dict(model.named_parameters())
        if shapes is not None:
            params = {
                name: params[name][tuple(slice(0, int(n)) for n in shape)]
                for name, shape in shapes.items()
                if name in params
            }
        return {
            name: [digest(p), str(p.dtype).removeprefix("torch."), list(p.shape)]
            for name, p in params.items()
        }
