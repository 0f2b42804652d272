"""The optimizer side of the modules: float32 masters for low-precision trainable weights, and AdamW
with torch's fused kernel wherever every parameter allows it."""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "FUSED_ADAMW_DEVICES",
    "FUSED_ADAMW_DTYPES",
    "LOW_PRECISION_DTYPES",
    "adamw",
    "upcast_trainable_parameters",
]

LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)
"""Compute dtypes that get float32 master weights."""


def upcast_trainable_parameters(module: torch.nn.Module) -> int:
    """Make every trainable low-precision (bf16/fp16) parameter of ``module`` a float32 master, in
    place (the ``Parameter`` objects stay: ties and references hold). Frozen parameters keep their
    dtype. Idempotent; returns how many parameters were upcast."""
    count = 0
    for param in module.parameters():
        if param.requires_grad and param.dtype in LOW_PRECISION_DTYPES:
            param.data = param.data.float()
            count += 1
    return count


FUSED_ADAMW_DEVICES = ("cuda", "cpu")
FUSED_ADAMW_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def adamw(params: list[torch.nn.Parameter], allow_fused: bool = True, **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, **kwargs)`` with torch's fused kernel (one pass over each
    parameter, its gradient and both moments) where every parameter allows it: floating (float32,
    bf16, fp16, float64) on one CUDA or CPU device, a ``DTensor`` shard included; else (or with
    ``allow_fused=False``) torch's default implementation (on CPU a Python loop of about ten tensor
    ops per parameter). The update is the same AdamW (bit for bit on CPU float32 in the tests); HF
    ``Trainer`` (so TRL) uses the fused kernel by default too. Measured in
    ``python benchmarks/optimizer_step.py`` (in git history; its conclusion in docs/benchmarks.md).

    >>> adamw([torch.nn.Parameter(torch.zeros(2))], lr=0.1).param_groups[0]["fused"]
    True
    >>> adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))], lr=0.1).param_groups[0]["fused"]
    """
    devices = {p.device.type for p in params}
    fused = allow_fused and len(devices) == 1 and devices <= set(FUSED_ADAMW_DEVICES)
    fused = fused and all(p.dtype in FUSED_ADAMW_DTYPES for p in params)
    return torch.optim.AdamW(params, fused=True if fused else None, **kwargs)
