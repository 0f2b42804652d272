"""One host copy of the model per node: the other ranks build it on the meta device and receive rank 0's weights.

Every rank of a DDP / FSDP launch runs the script and builds the module, so without this each rank of a
node loads the whole model into host memory, all at once (eight ranks of a 7B bf16 model: eight copies
of 15 GB before anything reaches a GPU). With a causal-LM module's ``load_once_per_node`` on (the
default), a node-local rank > 0 (:func:`launched_as_local_rank_above_zero`, read from the launch
environment) builds its networks on the meta device: names, shapes and dtypes, no values, no memory.
Its ``configure_model``, which Lightning calls after the module's ``setup`` (the KL reference copy, the
float32 masters) and before the strategy wraps the module or any weight is pushed, then:

1. checks that every rank built the same networks (:func:`ranks_to_fill`: one gather of every rank's
   names, shapes and dtypes; a rank that built another model fails on every rank at once, naming the
   first difference, instead of a broadcast hanging or filling the wrong shapes), and that some rank
   is on the meta device (otherwise nothing is sent: a second ``configure_model``, a spawn launcher);
2. without sharding (DDP): puts every rank's module on its training device (the meta tensors as
   uninitialised storage, :func:`materialize`) and broadcasts every parameter and buffer from global
   rank 0 (:func:`fill_from_rank0`);
3. with FSDP2: takes rank 0's full state dict of each network before ``fully_shard``
   (:func:`full_states`), and after it materialises the meta shards on the device and loads rank 0's
   state with ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` (rank 0 sends
   each tensor whole, every rank keeps its shard), then broadcasts the buffers: a non-persistent buffer
   (rotary ``inv_freq``) is in no state dict, and ``to_empty`` leaves it uninitialised.

On GPUs the ranks > 0 therefore never hold the model on the host: their storage is created on their
GPU and filled there (NCCL broadcasts device tensors). On CPU the training device is the host, so each
DDP rank still ends up holding its replica; what it saves is the load itself (``benchmarks/performance/rank_load_memory.py``).
Each node's local rank 0 loads (rank 0 of every node, so the host holds at most one copy per node);
global rank 0's values are the ones every rank ends with.

Nothing reads a weight of a rank > 0 before it is filled: the module's checks at construction read the
config and the tokenizer, ``setup`` copies (the reference) and casts (the masters) meta tensors, and the
rollout side starts in the strategy's ``setup``, after ``configure_model``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "LOCAL_RANK_VARIABLES",
    "fill_from_rank0",
    "full_states",
    "has_meta_tensors",
    "launched_as_local_rank_above_zero",
    "layout",
    "layout_difference",
    "materialize",
    "node_local_rank",
    "ranks_to_fill",
]

LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID")
"""Where a launcher puts a process's rank on its node, in the order they are read: ``LOCAL_RANK``
(torchrun; Lightning's launcher, in the processes it starts for ranks > 0), ``SLURM_LOCALID`` (srun)."""


def node_local_rank(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """The first of :data:`LOCAL_RANK_VARIABLES` set to a non-negative integer in ``environ``
    (default: this process's environment), with its value; None when no launcher set one.

    >>> node_local_rank({"SLURM_LOCALID": "3"})
    ('SLURM_LOCALID', 3)
    >>> node_local_rank({"LOCAL_RANK": "0", "SLURM_LOCALID": "3"})
    ('LOCAL_RANK', 0)
    """
    environ = os.environ if environ is None else environ
    for name in LOCAL_RANK_VARIABLES:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return name, int(value)
    return None


def launched_as_local_rank_above_zero(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the launch environment makes this process a node-local rank > 0 of a multi-process
    launch (:func:`node_local_rank` above 0): a rank that need not load the weights itself. A single
    process, and the first process of each node, read False."""
    found = node_local_rank(environ)
    return found is not None and found[1] > 0


def has_meta_tensors(module: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (has no values)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def materialize(module: torch.nn.Module, device: torch.device | str) -> None:
    """``module.to_empty(device=device)`` (every tensor as uninitialised storage on ``device``), with
    the parameters several submodules share (tied embeddings) shared again: ``to_empty`` gives each
    occurrence a tensor of its own when it leaves the meta device."""
    names_by_param: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names_by_param.setdefault(id(param), []).append(name)
    module.to_empty(device=device)
    for first, *others in names_by_param.values():
        shared = module.get_parameter(first)
        for name in others:
            if module.get_parameter(name) is not shared:
                owner, _, attr = name.rpartition(".")
                setattr(module.get_submodule(owner), attr, shared)


def layout(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, dtype)`` of every parameter (shared ones under each of their names) and buffer
    of ``module``: what two ranks must agree on before one fills the other's tensors."""
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in named]


def layout_difference(reference: list[tuple], other: list[tuple], rank: int) -> str | None:
    """The first difference between rank 0's :func:`layout` and rank ``rank``'s, in words; None when
    they agree.

    >>> layout_difference([("w", (2, 3), "float32")], [("w", (2, 4), "float32")], 1)
    'w is (2, 3) float32 on rank 0 and (2, 4) float32 on rank 1'
    >>> layout_difference([("w", (2,), "float32")], [("w", (2,), "float32"), ("b", (2,), "float32")], 1)
    'b is on rank 1 and not on rank 0'
    """
    ours = {name: rest for name, *rest in reference}
    theirs = {name: rest for name, *rest in other}
    for name, *rest in reference:
        if name not in theirs:
            return f"{name} is on rank 0 and not on rank {rank}"
        if theirs[name] != rest:
            (shape, dtype), (other_shape, other_dtype) = rest, theirs[name]
            return f"{name} is {shape} {dtype} on rank 0 and {other_shape} {other_dtype} on rank {rank}"
    for name, *_ in other:
        if name not in ours:
            return f"{name} is on rank {rank} and not on rank 0"
    return None


def ranks_to_fill(module: torch.nn.Module, setting: str) -> bool:
    """Whether :func:`fill_from_rank0` must run: some rank of the default process group holds meta
    tensors. A collective over the group (every rank calls it at the same point); it checks first that
    every rank's :func:`layout` is rank 0's. In one process it is False, and an error when ``module``
    has meta tensors (there is no rank 0 to receive from).

    Raises:
        ValueError: a rank's networks differ from rank 0's (on every rank, naming the rank and the
            first difference), or meta tensors in a single process (naming ``setting``).
    """
    meta = has_meta_tensors(module)
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        if meta:
            found = node_local_rank()
            where = f"{found[0]}={found[1]}" if found else "no launcher variable"
            raise ValueError(
                f"the model was built on the meta device ({setting}=True, and {where} makes this process a "
                "node-local rank > 0 of a multi-process launch), but this process trains alone: there is no "
                "rank 0 to receive the weights from. Train it under a multi-rank strategy "
                f"(AsyncRolloutDDPStrategy, AsyncRolloutFSDPStrategy) on every rank, or set {setting}=False"
            )
        return False
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (meta, layout(module)))
    reference = gathered[0][1]
    for rank, (_, theirs) in enumerate(gathered[1:], start=1):
        difference = layout_difference(reference, theirs, rank)
        if difference is not None:
            raise ValueError(
                f"rank {rank} built other networks than rank 0 ({difference}), "
                f"so it cannot receive rank 0's weights ({setting}=True): every rank must build the module "
                "from the same settings"
            )
    return any(rank_meta for rank_meta, _ in gathered)


def full_states(module: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Before sharding: each child network of ``module`` that has parameters, by name, with its full
    state dict on global rank 0 (its tensors, not copies) and ``{}`` on the other ranks, for
    :func:`fill_from_rank0` to send after ``fully_shard``."""
    rank0 = torch.distributed.get_rank() == 0
    return {
        name: child.state_dict() if rank0 else {}
        for name, child in module.named_children()
        if next(child.parameters(), None) is not None
    }


def fill_from_rank0(
    module: torch.nn.Module,
    device: torch.device | str,
    states: dict[str, dict[str, torch.Tensor]] | None = None,
) -> None:
    """Give every rank global rank 0's parameters and buffers of ``module``, on ``device`` (the rank's
    training device: NCCL moves device tensors, gloo host ones). A collective over the default process
    group, after :func:`ranks_to_fill` said so.

    Without ``states`` (no sharding) every rank's module goes to ``device`` (a rank on the meta device
    gets uninitialised storage there) and each parameter and buffer is broadcast from rank 0. With
    ``states`` (:func:`full_states`, taken before ``fully_shard``) each of those child networks has been
    sharded: its meta shards are materialised on ``device`` and it loads rank 0's full state, each rank
    keeping its shard; then the buffers of ``module`` are broadcast (non-persistent ones are in no
    state dict)."""
    dist = torch.distributed
    with torch.no_grad():
        if states is None:
            if has_meta_tensors(module):
                materialize(module, device)
            else:
                module.to(device)
            for tensor in module.parameters():
                dist.broadcast(tensor.detach(), src=0)
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            for name, state in states.items():
                child = module.get_submodule(name)
                if has_meta_tensors(child):
                    materialize(child, device)
                set_model_state_dict(child, state, options=options)
            states.clear()  # rank 0's full tensors can go
        for buffer in module.buffers():
            dist.broadcast(buffer.detach(), src=0)
