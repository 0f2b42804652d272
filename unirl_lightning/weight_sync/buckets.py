"""The one bucketing routine: how a full weight push is cut into transfers of bounded size.

Used by the collective backend (flat, dtype-homogeneous buckets for ``broadcast``) and by the
serving engines (vLLM and SGLang load a bucket at a time and need every decoder layer whole,
because they fuse q/k/v and gate/up into one parameter per layer); and the packed forms a push
travels in (:class:`PackedWeights` through Ray's object store, :func:`pack_tensors` to vLLM's
engine-core process).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

NamedTensor = tuple[str, torch.Tensor]


def cast_floating(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` in ``dtype`` if it is floating and of another dtype (a new tensor, rounded to
    nearest even, as autocast rounds a float32 master for a bf16 matmul), else ``tensor`` itself.
    ``dtype=None`` casts nothing. Works on a ``DTensor`` shard too (each rank casts its own part).

    >>> cast_floating(torch.tensor([1.0 + 2**-10]), torch.bfloat16)
    tensor([1.], dtype=torch.bfloat16)
    >>> cast_floating(torch.tensor([3]), torch.bfloat16).dtype
    torch.int64
    """
    if dtype is None or not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    return tensor.detach().to(dtype)


def cast_named(named_tensors: Iterable[NamedTensor], dtype: torch.dtype | None) -> Iterator[NamedTensor]:
    """``(name, cast_floating(tensor, dtype))``, lazily: one cast copy alive at a time if the
    consumer drops each before taking the next (a bucket at a time if it keeps a bucket)."""
    for name, tensor in named_tensors:
        yield name, cast_floating(tensor, dtype)


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
    named_tensors: Iterable[NamedTensor],
    bucket_bytes: int,
    *,
    whole_layers: bool = False,
    dtype: torch.dtype | None = None,
) -> Iterator[list[NamedTensor]]:
    """Consecutive buckets of at most ``bucket_bytes`` (a unit larger than that is a bucket alone).

    ``whole_layers=False``: the unit is one tensor, and a bucket holds one dtype (so it can be
    flattened into a single tensor); the tensors are read lazily. ``whole_layers=True``: the unit is
    a layer (see :func:`layer_of`), never split across buckets. ``dtype``: sizes are counted as the
    floating tensors will travel once cast to it (:func:`cast_floating`), the tensors are left as
    they are (a sharded tensor counts its whole size).

    >>> ts = [("a", torch.zeros(4)), ("b", torch.zeros(4)), ("c", torch.zeros(4, dtype=torch.int64))]
    >>> [[n for n, _ in b] for b in weight_buckets(ts, bucket_bytes=32)]
    [['a', 'b'], ['c']]
    """
    units: Iterable[list[NamedTensor]]
    if whole_layers:
        by_layer: dict[str, list[NamedTensor]] = {}
        seen_layer = False
        for name, tensor in named_tensors:
            key = layer_of(name, seen_layer)
            seen_layer = seen_layer or key not in ("pre", "post")
            by_layer.setdefault(key, []).append((name, tensor))
        units = list(by_layer.values())
    else:
        units = ([item] for item in named_tensors)
    bucket: list[NamedTensor] = []
    size = 0
    for unit in units:
        unit_size = sum(t.numel() * _travel_itemsize(t, dtype) for _, t in unit)
        new_dtype = not whole_layers and bucket and bucket[-1][1].dtype != unit[0][1].dtype
        if bucket and (size + unit_size > bucket_bytes or new_dtype):
            yield bucket
            bucket, size = [], 0
        bucket.extend(unit)
        size += unit_size
    if bucket:
        yield bucket


def _travel_itemsize(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    if dtype is not None and tensor.is_floating_point():
        return dtype.itemsize
    return tensor.element_size()


@dataclass(frozen=True)
class PackedWeights:
    """A full push as one object for Ray's object store: names, dtypes, shapes and one ``uint8``
    numpy view per tensor.

    Ray stores every numpy array out of band: ``ray.put`` copies each tensor once, into shared
    memory, and a worker on the same node reads it back without a copy (read-only views of that
    memory). So a push costs one copy on the trainer's side and one on each worker's (the engine
    copying into its parameters); a flat buffer cost three more.

    >>> packed = PackedWeights.pack([("w", torch.arange(4.0).reshape(2, 2))])
    >>> [(name, t.tolist()) for name, t in packed.tensors()]
    [('w', [[0.0, 1.0], [2.0, 3.0]])]
    """

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    arrays: tuple[np.ndarray, ...]

    @classmethod
    def pack(cls, named_tensors: Iterable[NamedTensor], dtype: torch.dtype | None = None) -> PackedWeights:
        """Pack ``named_tensors``; with ``dtype``, every floating tensor is first cast to it
        (:func:`cast_floating`), one tensor at a time, on its own device, before its host copy."""
        names: list[str] = []
        dtypes: list[str] = []
        shapes: list[tuple[int, ...]] = []
        arrays: list[np.ndarray] = []
        for name, tensor in cast_named(named_tensors, dtype):
            names.append(name)
            dtypes.append(str(tensor.dtype).removeprefix("torch."))
            shapes.append(tuple(tensor.shape))
            # a view of each tensor's bytes (no copy for a contiguous CPU tensor): the put copies
            arrays.append(_flat_bytes(tensor).numpy())
        return cls(names=tuple(names), dtypes=tuple(dtypes), shapes=tuple(shapes), arrays=tuple(arrays))

    def tensors(self) -> list[NamedTensor]:
        """The ``(name, tensor)`` pairs, as views of the arrays: after a ``ray.get`` they are views of
        shared memory that other workers read too, so a consumer copies from them and never writes
        to them or keeps them (:meth:`RolloutEngine.load_weights`'s contract)."""
        with warnings.catch_warnings():  # the arrays Ray returns are read-only: we only read them
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return [
                (name, torch.from_numpy(array).view(getattr(torch, dtype)).reshape(shape))
                for name, dtype, shape, array in zip(self.names, self.dtypes, self.shapes, self.arrays)
            ]


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def pack_tensors(named_tensors: Iterable[NamedTensor], as_bytes: bool = False) -> dict[str, Any]:
    """Tensors as their names, dtypes, shapes and one flat ``uint8`` buffer (with ``as_bytes``, a byte
    string): what vLLM's msgpack RPC carries to its engine-core process, which does not rebuild
    tensors nested in call arguments."""
    named = list(named_tensors)
    flat = [_flat_bytes(t) for _, t in named]
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
    with warnings.catch_warnings():  # read-only bytes: read once, by the clones below
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        data = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else None
    named: list[NamedTensor] = []
    offset = 0
    for name, dtype_name, shape in zip(packed["names"], packed["dtypes"], packed["shapes"]):
        dtype = getattr(torch, dtype_name)
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        named.append((name, data[offset : offset + nbytes].clone().view(dtype).reshape(shape)))
        offset += nbytes
    return named
