"""The weight-sync contract and what every backend shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from unirl_lightning.distributed.sharding import full_tensor, is_sharded
from unirl_lightning.weight_sync.buckets import cast_floating

SERVING_DTYPE_ATTR = "_unirl_serving_dtype"


@dataclass
class SyncStats:
    time_s: float
    bytes: int
    num_tensors: int


class PushTargets(Protocol):
    """What a backend pushes to: the rollout worker group (:class:`~unirl_lightning.workers.RolloutWorkerGroup`):
    its live actors and how many replacements it may still make (a backend that cannot feed a
    replacement refuses up front when ``max_restarts`` > 0)."""

    workers: list[Any]
    max_restarts: int


class WeightSync(Protocol):
    """``push`` the model's weights to the workers, labelled ``weight_version``; ``close`` frees what
    the backend holds.

    Optional: ``resend(workers, weight_version) -> SyncStats | None`` loads the last push again into
    ``workers`` (a replaced worker) when it was of ``weight_version``, without reading the model (no
    gather, so no collective), and returns None when it cannot. The rollout runtime calls it first
    when a worker is replaced (:class:`ObjectStoreWeightSync` implements it)."""

    def push(self, model: torch.nn.Module, workers: PushTargets, weight_version: int) -> SyncStats: ...

    def close(self) -> None: ...


def weight_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors an engine needs, by the names its own copy of the model uses, as the model holds
    them (a sharded model's are ``DTensor`` shards: read them whole with
    :func:`~unirl_lightning.distributed.sharding.full_tensor`, or call :func:`named_weights`).

    For a ``peft`` model with LoRA adapters only the adapter tensors are returned (adapter-only
    sync); otherwise every parameter and floating buffer of the model's state dict, each storage
    once: a tied weight (e.g. ``lm_head.weight`` tied to the input embedding) travels under its
    first name only, and the engine's copy, tied the same way, receives it through that name.
    """
    try:
        from peft import PeftModel, get_peft_model_state_dict
    except ImportError:  # pragma: no cover - peft is a runtime dependency
        PeftModel = None  # noqa: N806
    if PeftModel is not None and isinstance(model, PeftModel):
        return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}
    tensors: dict[str, torch.Tensor] = {}
    seen: set[Any] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        # a shard's local storage can be empty (a small tensor on a high rank): shards are told
        # apart by object (tied names share one parameter object), plain tensors by storage
        key = (
            id(tensor)
            if is_sharded(tensor)
            else (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        )
        if tensor.is_floating_point() and key not in seen:
            seen.add(key)
            tensors[name] = tensor.detach()
    return tensors


def set_serving_dtype(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    """Record on ``model`` the dtype the engines serve its weights in (a model trained on float32
    masters for a bf16 policy: bf16); pushes cast its floating tensors to it (:func:`serving_dtype`).
    None = push every tensor as held."""
    setattr(model, SERVING_DTYPE_ATTR, dtype)


def serving_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype a push casts ``model``'s floating tensors to (see :func:`set_serving_dtype`), or None."""
    return getattr(model, SERVING_DTYPE_ATTR, None)


def named_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """:func:`weight_tensors`, whole. A sharded (FSDP2) model's tensors are gathered one at a time
    and each is moved to the host as soon as it is whole (the training device holds one gathered
    tensor at a time): a collective that every training rank enters with the same model.

    With ``dtype``, a sharded tensor is cast to it before the gather (each rank casts its shard,
    so the gather moves the serving dtype); unsharded tensors are returned as held, and a consumer
    casts them one at a time (:meth:`~unirl_lightning.weight_sync.buckets.PackedWeights.pack`
    does), so no cast copy of the whole model is ever held on the training device."""
    return {
        name: full_tensor(cast_floating(t, dtype)).cpu() if is_sharded(t) else t
        for name, t in weight_tensors(model).items()
    }


def pushed_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``tensor`` travels in when a push casts to ``dtype`` (see :func:`cast_floating`)."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def tensor_bytes(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> int:
    """Bytes of ``tensors`` as a push casting to ``dtype`` moves them."""
    return sum(t.numel() * pushed_dtype(t, dtype).itemsize for t in tensors.values())
