"""Token-batch helpers of the causal-LM modules: the batch's token fields, row widths, the first
trained column, the model capabilities the log-prob pass reads (activation checkpointing,
``logits_to_keep``), and the log-prob pass itself."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

from unirl_lightning.algorithms import entropy_from_logits, token_logprobs
from unirl_lightning.models.lora import unwrapped

__all__ = [
    "SEQUENCE_UNIT_METRICS",
    "TOKEN_FIELDS",
    "accepts_logits_to_keep",
    "enable_gradient_checkpointing",
    "first_response_column",
    "row_widths",
    "sequence_logprobs",
]


TOKEN_FIELDS = ("input_ids", "attention_mask", "response_mask", "rollout_logprobs")
"""The ``[N, L]`` tensors of an :class:`~unirl_lightning.rollout.batches.ExperienceBatch`."""

SEQUENCE_UNIT_METRICS = frozenset({"ratio_mean", "clip_fraction", "dual_clip_fraction"})
"""The loss metrics that are means over sequences at ``ratio_level="sequence"``."""


def row_widths(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[N]`` the columns each row needs: one past its last attended position (0 for an empty row)."""
    attended = attention_mask.bool()
    columns = torch.arange(1, attended.shape[1] + 1, device=attended.device)
    return (columns * attended).amax(dim=1) if attended.shape[1] else attended.sum(dim=1)


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """``transformers``' activation checkpointing of every block of ``model`` (PEFT-wrapped or not),
    non-reentrant (``torch.utils.checkpoint`` with ``use_reentrant=False``: frozen embeddings, LoRA
    and FSDP2 need no input that requires grad). Active in training mode only."""
    target = unwrapped(model)
    if hasattr(target, "activation_checkpointing_enable"):  # transformers >= 5 (the old name is deprecated)
        target.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(target, "gradient_checkpointing_enable"):
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise ValueError(
            f"gradient_checkpointing needs a transformers model (activation_checkpointing_enable), got "
            f"{type(target).__name__}"
        )


def first_response_column(response_mask: torch.Tensor) -> int:
    """The first column ``t`` of ``[N, L-1]`` next-token log-probs that any row trains on (the
    position before the earliest response token); 0 when the mask is empty."""
    columns = response_mask[:, 1:].any(dim=0).nonzero()
    return int(columns[0]) if len(columns) else 0


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the (PEFT-unwrapped) ``transformers`` model computes logits for the last positions only."""
    return "logits_to_keep" in inspect.signature(unwrapped(model).forward).parameters


def sequence_logprobs(
    model: torch.nn.Module,
    batch: Any,
    temperature: float,
    autocast: Callable[[str], contextlib.AbstractContextManager],
    entropy: bool = False,
    entropy_grad: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of every next token of token batch ``batch``, ``[N, L-1]``, at ``temperature`` (with
    ``entropy=True`` also the policy's entropy at every position, detached unless ``entropy_grad``).

    Only positions from the batch's first response token on get logits (``logits_to_keep`` where the
    model takes it): the vocabulary projection of prompt positions, most of a real model's logits
    (49k x width per position for SmolLM2), is never computed; earlier positions read 0 (they are
    masked out of every loss).

    The forward runs under ``autocast(device_type)`` (a bf16 policy: bf16 logits from float32
    masters); the log-probs are float32 from chunked reductions, never a float32 copy of all the
    logits."""
    width = batch.input_ids.shape[1]
    start = first_response_column(batch.response_mask) if accepts_logits_to_keep(model) else 0
    kwargs = {"logits_to_keep": width - start} if start > 0 else {}
    with autocast(batch.input_ids.device.type):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **kwargs).logits
    # positions start .. L-1; start .. L-2 predict tokens start+1 .. L-1. The logits go in whole
    # (a dummy token for L-1, whose result is dropped): a slice of them, even a full-range one,
    # would make its backward allocate a zero gradient of the full [N, L, V] logits
    if logits.shape[1] != width - start:
        logits = logits[:, start:]
    targets = torch.nn.functional.pad(batch.input_ids[:, start + 1 :], (0, 1))
    logp = token_logprobs(logits, targets, temperature)[:, :-1]
    if start > 0:
        logp = torch.nn.functional.pad(logp, (start, 0))
    if not entropy:
        return logp
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ent = entropy_from_logits(logits, temperature)[:, :-1]
        return logp, torch.nn.functional.pad(ent, (start, 0)) if start > 0 else ent
