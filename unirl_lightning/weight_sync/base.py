"""The weight-sync contract and what every backend shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class SyncStats:
    time_s: float
    bytes: int
    num_tensors: int


class WeightSync(Protocol):
    def push(self, model: torch.nn.Module, workers: Any, weight_version: int) -> SyncStats: ...

    def close(self) -> None: ...


def named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors an engine needs, by the names its own copy of the model uses.

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
    seen: set[tuple[int, int]] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if tensor.is_floating_point() and key not in seen:
            seen.add(key)
            tensors[name] = tensor.detach()
    return tensors


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
