"""Sharded training (FSDP2): how a module's networks are cut into shards, and how full weights are read back.

:func:`shard_children` is what an RL module's ``configure_model`` does under
:class:`~unirl_lightning.strategy.AsyncRolloutFSDPStrategy`: every network the module trains or
reads (policy, frozen reference, critic) becomes an FSDP2 module over the strategy's device mesh,
with one shard group per transformer block (the classes a ``transformers`` model lists in
``_no_split_modules``) and one for the rest (embeddings, final norm, head; tied weights stay tied).
Parameters become ``DTensor`` shards; forward and backward gather a block at a time.

Mixed precision: when the module computes in bf16/fp16 over float32 masters (its
``compute_dtype``, see :class:`~unirl_lightning.modules.base.PolicyGradientModule`), every group gets
``MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=float32)``: the float32 shards are
gathered in the low dtype and gradients are reduced in float32. FSDP2 needs the *trainable*
parameters of a group to share one dtype; the module's setup makes them all float32 (frozen ones,
e.g. LoRA base weights, may differ: they are cast to ``param_dtype`` for the gather too).

:func:`full_tensor` reads a parameter back whole for a weight push. It is a collective: every rank
calls it for the same tensors in the same order (a weight sync is entered by every rank at the
same RL step, so it is).
"""

from __future__ import annotations

from typing import Any

import torch


def block_classes(network: torch.nn.Module) -> set[str]:
    """The class names of the repeated blocks of ``network`` (the ``_no_split_modules`` of every
    ``transformers`` model inside it, also under a PEFT wrapper or a critic's backbone)."""
    names: set[str] = set()
    for module in network.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def mixed_precision_policy(compute_dtype: torch.dtype | None) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for a module computing in ``compute_dtype``: gather in it and
    reduce gradients in float32 when it is bf16/fp16; the default policy (no casts) otherwise."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if compute_dtype in (torch.bfloat16, torch.float16):
        return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_children(module: torch.nn.Module, mesh: Any) -> list[str]:
    """Shard every child network of ``module`` that has parameters over ``mesh`` (FSDP2
    ``fully_shard``: a 1-D mesh shards over all ranks; a 2-D mesh replicates over its first dimension
    and shards over its second, HSDP), with the :func:`mixed_precision_policy` of the module's
    ``compute_dtype`` attribute (None when it has none). Idempotent (Lightning may call
    ``configure_model`` again). Returns the names of the children sharded now."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mp_policy = mixed_precision_policy(getattr(module, "compute_dtype", None))
    sharded = []
    for name, child in module.named_children():
        if isinstance(child, FSDPModule) or next(child.parameters(), None) is None:
            continue
        blocks = block_classes(child)
        for sub in [m for m in child.modules() if m is not child and type(m).__name__ in blocks]:
            fully_shard(sub, mesh=mesh, mp_policy=mp_policy)
        fully_shard(child, mesh=mesh, mp_policy=mp_policy)
        sharded.append(name)
    return sharded


def is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: a DTensor shard is gathered from every rank (collective), any other tensor
    is returned as it is."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def local_numel(module: torch.nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole model) over ``module``'s parameters."""
    held = total = 0
    for p in module.parameters():
        held += p.to_local().numel() if is_sharded(p) else p.numel()
        total += p.numel()
    return held, total
