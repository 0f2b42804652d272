"""The weight-sync contract and what every backend shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from unirl_lightning.sharding import full_tensor, is_sharded


@dataclass
class SyncStats:
    time_s: float
    bytes: int
    num_tensors: int


class WeightSync(Protocol):
    def push(self, model: torch.nn.Module, workers: Any, weight_version: int) -> SyncStats: ...

    def close(self) -> None: ...


def weight_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors an engine needs, by the names its own copy of the model uses, as the model holds
    them (a sharded model's are ``DTensor`` shards: read them whole with
    :func:`~unirl_lightning.sharding.full_tensor`, or call :func:`named_weights`).

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


def named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """:func:`weight_tensors`, whole. A sharded (FSDP2) model's tensors are gathered one at a time
    and each is moved to the host as soon as it is whole (the training device holds one gathered
    tensor at a time): a collective that every training rank enters with the same model."""
    return {name: full_tensor(t).cpu() if is_sharded(t) else t for name, t in weight_tensors(model).items()}


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
