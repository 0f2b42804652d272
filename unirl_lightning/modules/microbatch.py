"""Micro-batch packing and the cross-rank counts the update normalises by: rows packed within a token
budget, a plan split to a count, and the sums and maxima over the data-parallel ranks."""

from __future__ import annotations

import torch

__all__ = [
    "distributed_world_size",
    "global_token_count",
    "max_over_ranks",
    "mean_over_ranks",
    "pack_rows_by_tokens",
    "split_to_count",
]


def distributed_world_size() -> int:
    """The size of the default process group (what Lightning's DDP / FSDP strategies set up); 1
    when ``torch.distributed`` is not initialized."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_token_count(local: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """``local`` (a count, e.g. this rank's loss tokens) summed over the ranks of the default process
    group (one all-reduce), as a float64 scalar on ``device`` (default: ``local``'s; it must be the
    training backend's device: NCCL reduces CUDA tensors only). Without ``torch.distributed``, or on
    one rank, ``local`` as it is (in float64)."""
    total = local.detach().to(device=device or local.device, dtype=torch.float64).clone()
    if distributed_world_size() > 1:
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM)
    return total


def max_over_ranks(value: int, device: torch.device | str) -> int:
    """The largest ``value`` over the ranks of the default process group (one all-reduce on
    ``device``); ``value`` itself on one rank."""
    if distributed_world_size() == 1:
        return value
    largest = torch.tensor([value], dtype=torch.long, device=device)
    torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
    return int(largest.item())


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


def mean_over_ranks(metrics: dict[str, float], device: torch.device | str) -> dict[str, float]:
    """Each figure of ``metrics`` averaged over the ranks of the default process group that have it: the
    keys are the union over the ranks (gathered first, so a key one rank alone has, such as a reward
    part or an eviction counter, neither misaligns the reduced vector nor is lost), then one sum of
    values and of counts on ``device`` (the training backend's: NCCL reduces CUDA tensors only).
    ``metrics`` as floats on one rank.

    >>> mean_over_ranks({"b": 2, "a": 1}, "cpu")
    {'a': 1.0, 'b': 2.0}
    """
    if distributed_world_size() == 1:
        return {key: float(metrics[key]) for key in sorted(metrics)}
    gathered: list[list[str] | None] = [None] * distributed_world_size()
    torch.distributed.all_gather_object(gathered, sorted(metrics))
    names = sorted({key for keys in gathered for key in keys or []})
    values = [float(metrics.get(key, 0.0)) for key in names] + [float(key in metrics) for key in names]
    totals = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(totals, op=torch.distributed.ReduceOp.SUM)
    sums, counts = totals[: len(names)], totals[len(names) :]
    return dict(zip(names, (sums / counts).tolist()))
