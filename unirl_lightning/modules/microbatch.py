"""Micro-batches: how one mini-batch is cut into pieces whose gradients accumulate into its one
optimizer step, and put back together, so that the loss, the gradients and the logged metrics are
those of the whole mini-batch whatever the cut.

:class:`MicroBatcher` runs four steps, in this order:

1. **plan** the rows of each micro-batch: runs of ``max_rows``, or, for token rows, rows packed within
   ``max_tokens`` padded tokens (:func:`pack_rows_by_tokens`); with several ranks every rank runs as
   many micro-batches (a sharded model all-gathers in every forward);
2. **view** each one: its rows of the batch and of the step context, token rows cut to their longest
   row (only right padding goes);
3. **scale** each loss by the micro-batch's share of the mini-batch's normaliser (its loss units over
   the mini-batch's, or over the global token count across ranks), so the mini-batch's loss is the
   sum of the scaled micro-batch losses;
4. **combine** their metrics as the mini-batch's would be: the aggregated losses summed scaled, the
   maxima as the largest, the rest as means weighted by what each is a mean over.

:meth:`MicroBatcher.map` runs a no-grad per-token computation a micro-batch at a time and glues the
results back into ``[N, L-1]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from unirl_lightning.core.checks import require_at_least
from unirl_lightning.modules.context import StepContext
from unirl_lightning.modules.ranks import global_token_count, max_over_ranks
from unirl_lightning.modules.tokens import TOKEN_FIELDS, row_widths

__all__ = ["MicroBatch", "MicroBatcher", "pack_rows_by_tokens", "split_to_count"]

Units = Callable[[Any, StepContext], torch.Tensor]
"""``units(batch, context)``: what a loss over ``batch`` is a mean over (rows, or loss tokens), a scalar."""
MetricWeight = Callable[[Any, StepContext, str], torch.Tensor]
"""``weight(batch, context, key)``: what metric ``key`` of ``batch`` is a mean over, a scalar."""


def pack_rows_by_tokens(widths: list[int], max_tokens: int, max_rows: int | None = None) -> list[list[int]]:
    """Row indices packed into micro-batches whose padded size ``rows x longest row`` stays within
    ``max_tokens`` (and at most ``max_rows`` rows each), at least one row each: the rows are taken
    longest first and added to the current micro-batch while it fits (greedy). Each micro-batch
    lists its rows in ascending order; the micro-batches come longest first (the peak memory first)."""
    order = sorted(range(len(widths)), key=lambda i: -widths[i])  # stable: ties keep their order
    parts: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = widths[current[0]] if current else widths[i]  # longest first: the first is the widest
        full = max_rows is not None and len(current) >= max_rows
        if current and (full or (len(current) + 1) * longest > max_tokens):
            parts.append(sorted(current))
            current = []
        current.append(i)
    if current:
        parts.append(sorted(current))
    return parts


def split_to_count(parts: list[list[int]], count: int) -> list[list[int]]:
    """``parts`` split until there are ``count`` of them (each split halves the part with the most rows,
    so every budget still holds), or until every part has one row."""
    parts = [list(p) for p in parts]
    while len(parts) < count:
        widest = max(range(len(parts)), key=lambda i: len(parts[i]))
        rows = parts[widest]
        if len(rows) < 2:
            break
        parts[widest : widest + 1] = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    return parts


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a mini-batch: its rows (indices into the mini-batch), its batch and context,
    the factor of its loss, and whether its backward is the mini-batch's last (the one DDP reduces)."""

    batch: Any
    context: StepContext
    rows: torch.Tensor
    scale: torch.Tensor
    last: bool


class MicroBatcher:
    """Cuts mini-batches into micro-batches and puts their metrics back together (module docstring).

    Args:
        max_rows: at most this many rows per micro-batch; None = no row limit.
        max_tokens: at most this many padded tokens (``rows x longest row``) per micro-batch, at least
            one row each; token rows only. None = no token budget.
        token_rows: the batch's rows are right-padded token rows (an
            :class:`~unirl_lightning.rollout.batches.ExperienceBatch`): a micro-batch is cut to its
            longest row, and ``max_tokens`` may pack them.
    """

    SUMMED = frozenset({"loss", "pg_loss", "vf_loss"})
    """Aggregated losses: a mini-batch's is the sum of its micro-batches' scaled ones."""
    MAXIMA = frozenset({"ratio_dev_max"})
    """Maxima over the rows: a mini-batch's is the largest of its micro-batches'."""

    def __init__(
        self, max_rows: int | None = None, max_tokens: int | None = None, token_rows: bool = False
    ) -> None:
        if max_tokens is not None:
            require_at_least("micro_batch_tokens", max_tokens, 1)
            if not token_rows:
                raise ValueError("micro_batch_tokens packs token rows: this batch type has none")
        if max_rows is not None:
            require_at_least("micro_batch_rows", max_rows, 1)
        self.max_rows, self.max_tokens, self.token_rows = max_rows, max_tokens, token_rows

    @property
    def enabled(self) -> bool:
        """Whether mini-batches are cut at all (otherwise every mini-batch is one micro-batch)."""
        return self.max_rows is not None or self.max_tokens is not None

    # -- 1. plan --------------------------------------------------------------------------------
    def pack(self, batch: Any) -> list[list[int]]:
        """This rank's rows of each micro-batch: packed by ``max_tokens`` over the rows' widths, or in
        runs of ``max_rows``, or all rows in one."""
        if self.max_tokens is not None:
            widths = row_widths(batch.attention_mask).tolist()
            return pack_rows_by_tokens(widths, self.max_tokens, self.max_rows)
        n = batch.num_rows
        size = self.max_rows or max(n, 1)
        return [list(range(start, min(start + size, n))) for start in range(0, n, size)] or [[]]

    def plan(self, batch: Any, world: int, device: torch.device | str) -> list[torch.Tensor]:
        """Row-index tensors of the micro-batches of ``batch``. With ``world > 1`` ranks every rank gets
        as many (the most any rank packed: one all-reduce on ``device``, made only when cutting is on)."""
        parts = self.pack(batch)
        if self.enabled and world > 1:
            parts = split_to_count(parts, max_over_ranks(len(parts), device))
        return [torch.tensor(p, dtype=torch.long, device=batch.rewards.device) for p in parts]

    # -- 2. view --------------------------------------------------------------------------------
    def view(
        self, batch: Any, context: StepContext, rows: torch.Tensor, num_parts: int
    ) -> tuple[Any, StepContext]:
        """Micro-batch ``rows`` of ``batch`` with its context (the whole of them when it is the only
        one); token rows cut to the micro-batch's longest row: the ``[B, L]`` batch tensors to its
        width ``w``, the per-token ``[B, L-1]`` context tensors to ``w - 1`` columns (rows are
        right-padded: only padding is cut, and causal attention leaves every kept position's result
        as it was)."""
        if num_parts == 1 and len(rows) == batch.num_rows:
            return batch, context
        micro, micro_context = batch.select(rows), context.select(rows)
        if not self.token_rows:
            return micro, micro_context
        full = batch.input_ids.shape[1]
        width = max(int(row_widths(micro.attention_mask).max()), min(2, full)) if micro.num_rows else full
        if width == full:
            return micro, micro_context
        cut = {name: getattr(micro, name)[:, :width] for name in TOKEN_FIELDS}
        return replace(micro, **cut), micro_context.narrow(full - 1, width - 1)

    # -- 3. scale -------------------------------------------------------------------------------
    @staticmethod
    def normalizer(
        units: torch.Tensor,
        world: int = 1,
        device: torch.device | str | None = None,
        global_mean: bool = False,
    ) -> torch.Tensor:
        """The normaliser of a mini-batch's loss, shared by its micro-batches: its ``units`` (at least
        1); with ``global_mean`` over ``world > 1`` ranks, the units summed over the ranks (one
        all-reduce on ``device``) over the world size: each rank's loss is then its sum over the
        global count times the world size, which DDP / FSDP2's gradient averaging turns into the
        global mean."""
        if not global_mean or world == 1:
            return units.clamp(min=1)
        return global_token_count(units, device=device).clamp(min=1) / world

    def split(
        self,
        minibatch: Any,
        context: StepContext,
        units: Units,
        world: int,
        device: torch.device | str,
        global_mean: bool = False,
    ) -> list[MicroBatch]:
        """The micro-batches of ``minibatch``, each with its loss factor ``units(micro) / normaliser``
        (exactly 1 for the whole mini-batch on one rank)."""
        parts = self.plan(minibatch, world, device)
        normalizer = self.normalizer(units(minibatch, context), world, device, global_mean)
        micro_batches = []
        for i, rows in enumerate(parts):
            micro, micro_context = self.view(minibatch, context, rows, len(parts))
            scale = (units(micro, micro_context) / normalizer).to(torch.float32)
            micro_batches.append(MicroBatch(micro, micro_context, rows, scale, last=i == len(parts) - 1))
        return micro_batches

    # -- 4. combine -----------------------------------------------------------------------------
    def combine(
        self, results: list[tuple[MicroBatch, dict[str, torch.Tensor]]], weight: MetricWeight
    ) -> dict[str, torch.Tensor]:
        """The mini-batch's metrics from each micro-batch's: :attr:`SUMMED` ones as the sum of the
        scaled values (the loss that was backpropagated), :attr:`MAXIMA` as the largest, every other
        as the mean weighted by ``weight`` (a token mean stays a token mean)."""
        if len(results) == 1:
            micro, metrics = results[0]
            return {k: v * micro.scale if k in self.SUMMED else v for k, v in metrics.items()}
        combined = {}
        for key in results[0][1]:
            values = torch.stack([metrics[key].float() for _, metrics in results])
            if key in self.SUMMED:
                combined[key] = (values * torch.stack([micro.scale for micro, _ in results])).sum()
            elif key in self.MAXIMA:
                combined[key] = values.max()
            else:
                weights = torch.stack([weight(m.batch, m.context, key).float() for m, _ in results])
                combined[key] = (values * weights).sum() / weights.sum().clamp(min=1)
        return combined

    # -- no-grad passes -------------------------------------------------------------------------
    def map(
        self, batch: Any, compute: Callable[[Any], torch.Tensor], world: int, device: torch.device | str
    ) -> torch.Tensor:
        """``compute`` (a per-token ``[b, w-1]`` result, no gradient) over the micro-batches of token
        rows ``batch``, put together as ``[N, L-1]`` (zero past a micro-batch's width: padding)."""
        parts = self.plan(batch, world, device)
        if len(parts) == 1:
            return compute(batch)
        out: torch.Tensor | None = None
        for rows in parts:
            micro, _ = self.view(batch, StepContext(), rows, len(parts))
            value = compute(micro)
            if out is None:
                out = value.new_zeros((batch.num_rows, batch.input_ids.shape[1] - 1, *value.shape[2:]))
            out[rows.to(out.device), : value.shape[1]] = value
        return out
