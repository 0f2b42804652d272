"""What a runtime does to the training process's devices and placement report: hand the trainer's cached
blocks back, move the optimizer state to the host and back (colocate), and the rows and collectives of
the placement report."""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "OffloadedState",
    "free_trainer_memory",
    "gather_objects",
    "optimizers_to_device",
    "optimizers_to_host",
    "policy_device",
    "trainer_row",
]


def free_trainer_memory(device: Any) -> None:
    """Hand the trainer's cached, unused accelerator blocks back (``torch.cuda.empty_cache()`` on a CUDA
    training device; nothing elsewhere), so a colocated engine that wakes can take them."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


OffloadedState = list[tuple[dict[str, Any], str, Any]]
"""What :func:`optimizers_to_host` moved: ``(state, key, device)`` of each tensor, to move it back."""


def optimizers_to_host(optimizers: Any) -> OffloadedState:
    """Move every optimizer state tensor that is not on the host to the host (colocate: before the
    engines wake), returning where each one was (:func:`optimizers_to_device` moves them back)."""
    import torch

    moved: OffloadedState = []
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                    moved.append((state, key, value.device))
                    state[key] = value.to("cpu")
    return moved


def optimizers_to_device(moved: OffloadedState) -> None:
    """Move what :func:`optimizers_to_host` moved back to its device (colocate: after the engines sleep,
    before training)."""
    for state, key, device in moved:
        state[key] = state[key].to(device)


def policy_device(policy: Any) -> Any:
    """The device of ``policy``'s first parameter (the training device), CPU when it has none."""
    import torch

    for parameter in policy.parameters():
        return parameter.device
    return torch.device("cpu")


def trainer_row(rank: int, device: Any) -> dict[str, Any]:
    """This training rank's row of the placement report (its pid besides)."""
    import torch

    from unirl_lightning.workers.placement import trainer_placement_info, visible_gpu_ids

    visible = visible_gpu_ids(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
    return {**trainer_placement_info(rank, device, visible), "pid": os.getpid()}


def gather_objects(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj``, in rank order (``all_gather_object``: a collective of every rank)."""
    if world_size == 1:
        return [obj]
    import torch.distributed as dist

    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, obj)
    return gathered
