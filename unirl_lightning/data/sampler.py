"""The pass order of the training prompts: one rule for one rank and many.

:class:`PassSampler` orders pass ``e`` as ``DistributedSampler(seed=seed)`` does after
``set_epoch(e)``, so a resumed prompt stream that asks for its pass gets that pass's order again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from unirl_lightning.core.seeding import pass_seed

__all__ = ["PassSampler", "collate_records", "train_loader"]


def collate_records(batch: list[dict]) -> list[dict]:
    """``collate_fn`` that keeps a batch as the list of record dicts (module level: picklable)."""
    return list(batch)


class PassSampler(Sampler[int]):
    """Indices ``0..size-1`` in the order of pass ``epoch`` (a one-rank :class:`DistributedSampler`).

    Shuffled, pass ``e`` is ``torch.randperm(size)`` drawn from a generator seeded with ``seed + e``:
    exactly the order of ``DistributedSampler(num_replicas=1, rank=0, shuffle=True, seed=seed)`` after
    ``set_epoch(e)``, so one rank and several follow one rule. The order is a function of ``(seed, e)``
    only, so a resumed prompt stream that asks for its pass (``set_epoch``) gets that pass's order
    again. A pass iterated to its end moves on to the next one, so a plain loop over the loader (no
    ``set_epoch``) still reshuffles every time. Unshuffled, every pass is ``0..size-1``.
    """

    def __init__(self, size: int, shuffle: bool, seed: int) -> None:
        self.size = size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> list[int]:
        """The indices of pass ``epoch``."""
        if not self.shuffle:
            return list(range(self.size))
        generator = torch.Generator().manual_seed(pass_seed(self.seed, epoch))  # DistributedSampler's rule
        return torch.randperm(self.size, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        epoch = self.epoch
        yield from self.order(epoch)
        if self.epoch == epoch:  # a full pass, not re-positioned meanwhile: the next pass is next
            self.epoch = epoch + 1

    def __len__(self) -> int:
        return self.size


def train_loader(
    records: Any, batch_size: int, shuffle: bool, seed: int, world_size: int = 1, rank: int = 0
) -> DataLoader:
    """Full batches of records (the last partial batch is dropped), shuffled repeatably: pass ``e``'s
    order is a function of ``(seed, e)`` (the sampler's ``set_epoch(e)``), on one rank
    (:class:`PassSampler`) as on several (a ``DistributedSampler``, which Lightning then keeps, gives
    each rank its disjoint share of the pass)."""
    if world_size > 1:
        sampler = DistributedSampler(
            records, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=True
        )
        return DataLoader(
            records, batch_size=batch_size, sampler=sampler, drop_last=True, collate_fn=collate_records
        )
    return DataLoader(
        records,
        batch_size=batch_size,
        sampler=PassSampler(len(records), shuffle, seed),
        drop_last=True,
        collate_fn=collate_records,
        generator=torch.Generator().manual_seed(seed),  # the iterator's base seed: not the global RNG
    )
