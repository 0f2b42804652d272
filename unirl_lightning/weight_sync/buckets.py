"""The one bucketing routine: how a full weight push is cut into transfers of bounded size.

Used by the collective backend (flat, dtype-homogeneous buckets for ``broadcast``) and by the
serving engines (vLLM and SGLang load a bucket at a time and need every decoder layer whole,
because they fuse q/k/v and gate/up into one parameter per layer).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

NamedTensor = tuple[str, torch.Tensor]


def layer_of(name: str, seen_layer: bool) -> str:
    """The layer a weight belongs to: its name up to the first numeric segment
    (``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3``); weights outside every layer
    belong to ``"pre"`` (before the first layer) or ``"post"`` (after it)."""
    parts = name.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    if index is None:
        return "post" if seen_layer else "pre"
    return ".".join(parts[: index + 1])


def weight_buckets(
    named_tensors: Iterable[NamedTensor], bucket_bytes: int, *, whole_layers: bool = False
) -> Iterator[list[NamedTensor]]:
    """Consecutive buckets of at most ``bucket_bytes`` (a unit larger than that is a bucket alone).

    ``whole_layers=False``: the unit is one tensor, and a bucket holds one dtype (so it can be
    flattened into a single tensor). ``whole_layers=True``: the unit is a layer (see
    :func:`layer_of`), never split across buckets.

    >>> ts = [("a", torch.zeros(4)), ("b", torch.zeros(4)), ("c", torch.zeros(4, dtype=torch.int64))]
    >>> [[n for n, _ in b] for b in weight_buckets(ts, bucket_bytes=32)]
    [['a', 'b'], ['c']]
    """
    units: list[list[NamedTensor]] = []
    if whole_layers:
        by_layer: dict[str, list[NamedTensor]] = {}
        seen_layer = False
        for name, tensor in named_tensors:
            key = layer_of(name, seen_layer)
            seen_layer = seen_layer or key not in ("pre", "post")
            by_layer.setdefault(key, []).append((name, tensor))
        units = list(by_layer.values())
    else:
        units = [[item] for item in named_tensors]
    bucket: list[NamedTensor] = []
    size = 0
    for unit in units:
        unit_size = sum(t.numel() * t.element_size() for _, t in unit)
        new_dtype = not whole_layers and bucket and bucket[-1][1].dtype != unit[0][1].dtype
        if bucket and (size + unit_size > bucket_bytes or new_dtype):
            yield bucket
            bucket, size = [], 0
        bucket.extend(unit)
        size += unit_size
    if bucket:
        yield bucket


def pack_tensors(named_tensors: Iterable[NamedTensor], as_bytes: bool = False) -> dict[str, Any]:
    """Tensors as their names, dtypes, shapes and one flat ``uint8`` buffer: a single object to ship
    (Ray's object store hands a numpy buffer to every worker without a copy per tensor; with
    ``as_bytes`` it is a byte string, what vLLM's msgpack RPC carries)."""
    named = list(named_tensors)
    flat = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for _, t in named]
    data = torch.cat(flat).numpy() if flat else np.zeros(0, dtype=np.uint8)
    return {
        "names": [name for name, _ in named],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
        "data": data.tobytes() if as_bytes else data,
    }


def unpack_tensors(packed: dict[str, Any]) -> list[NamedTensor]:
    """The ``(name, tensor)`` pairs of :func:`pack_tensors` (fresh, aligned storages)."""
    raw = packed["data"]
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if len(raw) else None
    named: list[NamedTensor] = []
    offset = 0
    for name, dtype_name, shape in zip(packed["names"], packed["dtypes"], packed["shapes"]):
        dtype = getattr(torch, dtype_name)
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        named.append((name, data[offset : offset + nbytes].clone().view(dtype).reshape(shape)))
        offset += nbytes
    return named
