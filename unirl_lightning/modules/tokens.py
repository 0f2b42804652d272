"""Token-batch helpers of the causal-LM modules: the batch's token fields, row widths, the first
trained column, and the model capabilities the log-prob pass reads (activation checkpointing,
``logits_to_keep``)."""

from __future__ import annotations

import inspect

import torch

from unirl_lightning.lora import unwrapped

__all__ = [
    "SEQUENCE_UNIT_METRICS",
    "TOKEN_FIELDS",
    "accepts_logits_to_keep",
    "enable_gradient_checkpointing",
    "first_response_column",
    "row_widths",
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
