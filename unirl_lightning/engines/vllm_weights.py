"""How pushed weights get into a vLLM engine (the weights half of :class:`~unirl_lightning.engines.vllm.VLLMEngine`):
full weights in one of vLLM's own update sessions (``start_weight_update`` -> ``update_weights`` per
bucket -> ``finish_weight_update``, whole or streamed bucket by bucket, on the ``"unirl"`` backend of
:mod:`~unirl_lightning.engines.vllm_transfer`), LoRA adapters through files, and the collective
backend's two ways in: vLLM's worker process joins the weight-sync group itself
(``init_weight_transfer_engine``; one vLLM worker, full weights), or this process relays each bucket
as it arrives (LoRA, or several vLLM workers)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable
from typing import Any

import torch

from unirl_lightning.engines.serving import lora_adapter_config
from unirl_lightning.models.lora import is_lora_push
from unirl_lightning.weight_sync.buckets import layer_of, pack_tensors, weight_buckets

__all__ = ["VLLMWeights", "whole_layers_first"]

log = logging.getLogger(__name__)


def whole_layers_first(
    items: list[tuple[str, torch.Tensor]],
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """``items`` split into the layers that are complete (every layer but the last) and the last
    layer's tensors, which the next bucket may continue (a push's buckets can split a layer; vLLM's
    layerwise reload must see each layer whole)."""
    if not items:
        return [], []
    last = layer_of(items[-1][0], True)
    cut = len(items)
    while cut > 0 and layer_of(items[cut - 1][0], True) == last:
        cut -= 1
    return items[:cut], items[cut:]


class VLLMWeights:
    """The weight-loading methods of the vLLM engine (a mixin: it reads the engine's ``llm``,
    ``config``, ``lora``, ``model_path``, ``in_process``, ``weight_update`` and ``_tmp``)."""

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> None:
        self.wake(["weights"])
        items = list(named_tensors)
        if is_lora_push(items):
            self._load_lora(items, weight_version)
        else:
            self._load_full(items)
        self.weight_version = weight_version

    def _load_full(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self.begin_weight_load()
        try:
            self.load_weight_bucket(items)
        finally:  # an interrupted reload must still put every layer back
            self.finish_weight_load(None)
        self._weights_dropped = False  # every weight restored

    def init_weight_transfer(self, group: dict[str, Any] | None = None) -> None:
        """vLLM's ``init_weight_transfer_engine`` on every worker: the backend's reload setting, and the
        weight-sync group to join (``group``), if any."""
        info = {"reload": self.weight_update == "reload", "group": group}
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": info})

    # a streamed push (BucketedWeightLoader): one update session around every bucket of the push
    def begin_weight_load(self) -> None:
        self.wake(["weights"])  # colocated: the KV cache wakes after the push
        self.llm.collective_rpc("start_weight_update")
        self._session_open = True

    def load_weight_bucket(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full weights only (an adapter push is one ``load_weights``); the caller's buckets must not
        split a decoder layer (:func:`weight_buckets` with ``whole_layers=True``)."""
        for bucket in weight_buckets(
            list(named_tensors), int(self.config.bucket_mb * 1024**2), whole_layers=True
        ):
            self._update({"bucket": bucket if self.in_process else pack_tensors(bucket, as_bytes=True)})

    def _update(self, update_info: dict[str, Any]) -> None:
        """One ``update_weights`` chunk; when it fails, vLLM's worker ends the session itself (the
        backend puts every layer back), so :meth:`finish_weight_load` must not end it again. With
        several tensor-parallel workers only those whose chunk failed end theirs: the others' sessions
        are ended here (``unirl_end_open_session``), or every later push would fail at its start."""
        try:
            self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})
        except BaseException:
            self._session_open = False
            try:
                self.llm.collective_rpc("unirl_end_open_session")
            except Exception:  # the chunk's error is the one raised
                log.exception("ending the weight-update sessions left open after a failed chunk failed")
            raise

    def finish_weight_load(self, weight_version: int | None) -> None:
        if getattr(self, "_session_open", False):
            self._session_open = False
            self.llm.collective_rpc("finish_weight_update")
        self.llm.reset_prefix_cache()
        if weight_version is not None:  # a streamed push's end: every weight restored
            self.weight_version = weight_version
            self._weights_dropped = False

    def _load_lora(self, items: list[tuple[str, torch.Tensor]], weight_version: int) -> None:
        if self.lora is None:
            raise ValueError(
                "got LoRA adapter tensors but this engine was built without a LoraSpec (the module's lora "
                "is None)"
            )
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        tensors = {name: t.detach().to("cpu").contiguous() for name, t in items}
        adapter = lora_adapter_config(tensors, self.lora, self.model_path)
        self._lora_ids += 1
        path = os.path.join(self._tmp, f"lora-{self._lora_ids}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(adapter, f)
        request = LoRARequest(f"policy-v{weight_version}-{self._lora_ids}", self._lora_ids, path)
        engine = self.llm.llm_engine
        engine.add_lora(request)  # load now, so a bad adapter fails the push, not the next generate
        previous, previous_dir = self._lora_request, self._lora_dir
        self._lora_request, self._lora_dir = request, path
        if previous is not None:
            engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous_dir, ignore_errors=True)
        self.llm.reset_prefix_cache()

    # -- the collective backend (weight_sync/collective.py): vLLM's worker process is the member -----
    def _worker_is_member(self) -> bool:
        """Whether vLLM's worker joins the weight-sync group itself: full-weight pushes into one worker
        (LoRA adapters are loaded from files by the engine, here; with tensor or pipeline parallelism
        every vLLM worker would need a rank of its own, which the group does not hand out yet)."""
        parallel = self.llm.llm_engine.vllm_config.parallel_config
        return self.lora is None and int(parallel.world_size) == 1

    def join_weight_group(
        self, backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float
    ) -> None:
        """Join the trainer's weight-sync group as ``rank``: vLLM's worker process joins (its buffers
        on the worker's device), through ``collective_rpc``; with LoRA (adapters are written to files
        and added by the engine) or more than one vLLM worker, this process joins instead and each
        push goes through :meth:`load_weights`."""
        from unirl_lightning.weight_sync.collective import CollectiveReceiver

        self._weight_relay: CollectiveReceiver | None = None
        self.weight_group_pids: list[int] = []
        if not self._worker_is_member():
            self._weight_relay = CollectiveReceiver(backend, host, port, rank, world_size, timeout_s)
            return
        group = dict(
            host=host, port=int(port), rank=int(rank), world_size=int(world_size), timeout_s=float(timeout_s)
        )
        self.init_weight_transfer({"backend": backend, **group})
        self.weight_group_pids = [state["pid"] for state in self.llm.collective_rpc("unirl_transfer_state")]

    def receive_weights(self, layout: Any, dtypes: Any, weight_version: int) -> None:
        """Receive one broadcast push (``layout``: buckets of ``(name, shape)``; ``dtypes``: one per
        bucket) and serve it as ``weight_version``. In vLLM's worker each bucket is received in place
        and loaded inside one update session (begin -> receive and load -> finish, which resets the
        LoRA state and, here, the prefix cache); only the layout (lists) and dtype names cross
        ``collective_rpc``. The result of each worker (receiving pids per bucket, tensor count,
        digests when ``record_digests`` is set) is kept in ``last_receive``."""
        from unirl_lightning.weight_sync.collective import dtype_names, wire_layout

        if not hasattr(self, "_weight_relay"):
            raise RuntimeError(
                f"vLLM engine: receive_weights(weight_version={weight_version}) before join_weight_group"
            )
        if self._weight_relay is not None:
            self._relay(layout, dtypes, weight_version)
            return
        names = [name for bucket in layout for name, _ in bucket]
        if any(".lora_A." in name or ".lora_B." in name for name in names):
            raise ValueError(
                "got LoRA adapter tensors but this engine was built without a LoraSpec (the module's lora "
                "is None)"
            )
        self.begin_weight_load()
        try:
            digests = bool(getattr(self, "record_digests", False))
            self._update(
                {"layout": wire_layout(layout), "dtype_names": dtype_names(dtypes), "digests": digests}
            )
            self.last_receive = [
                state["last_receive"] for state in self.llm.collective_rpc("unirl_transfer_state")
            ]
        finally:  # an interrupted reload must still put every layer back
            self.finish_weight_load(None)
        self.weight_version = weight_version
        self._weights_dropped = False

    def _relay(self, layout: Any, dtypes: Any, weight_version: int) -> None:
        """This process is the group's member (LoRA, or several vLLM workers): LoRA adapters (small) are
        received whole and loaded from files; full weights go into vLLM bucket by bucket as they
        arrive, each bucket freed before the next is received, so the relay never holds more than one
        bucket (on its GPU under NCCL) beside the model; the sender's buckets hold whole layers."""
        relay = self._weight_relay
        assert relay is not None
        if self.lora is not None:
            self.load_weights(relay.receive(layout, dtypes), weight_version)
            return
        self.relayed_loads: list[int] = []  # the bytes of each load, for tests and the curious
        self.begin_weight_load()
        try:
            carry: list[tuple[str, torch.Tensor]] = []
            for bucket in relay.buckets(layout, dtypes):
                complete, carry = whole_layers_first(carry + bucket)
                carry = [(name, t.clone()) for name, t in carry]  # the received buffer goes with its bucket
                del bucket
                if complete:
                    self.relayed_loads.append(sum(t.numel() * t.element_size() for _, t in complete))
                    self.load_weight_bucket(complete)
                del complete
            if carry:
                self.relayed_loads.append(sum(t.numel() * t.element_size() for _, t in carry))
                self.load_weight_bucket(carry)
        finally:  # an interrupted reload must still put every layer back
            self.finish_weight_load(None)
        self.weight_version = weight_version
        self._weights_dropped = False

    def leave_weight_group(self) -> None:
        if getattr(self, "_weight_relay", None) is None and hasattr(self, "_weight_relay"):
            self.llm.collective_rpc("shutdown_weight_transfer_engine")
        self.__dict__.pop("_weight_relay", None)
