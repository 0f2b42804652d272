"""Counts and figures over the data-parallel ranks of the default process group: the world size, a
sum (the global token count a loss normalises by), a maximum (the micro-batch count every rank runs)
and a mean over the ranks that have a figure (the logged metrics). Each is the identity on one
process; each reduces on the device it is given, which must be the training backend's (NCCL
reduces CUDA tensors only)."""

from __future__ import annotations

import torch

__all__ = ["distributed_world_size", "global_token_count", "max_over_ranks", "mean_over_ranks"]


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
