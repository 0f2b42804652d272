"""The prompt records both rollout loops draw from (:class:`PromptStream`): passes over the training
dataloader in the sampler's order, records to relaunch first after a resume, and a position that
survives a checkpoint. Standard library only."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["PromptStream"]


class PromptStream:
    """The prompt batches a loop launches from: one endless pass after another over ``prompts`` (the
    datamodule's train dataloader), relaunches first after a resume, and a position that survives a
    checkpoint. Both rollout loops draw from one.

    ``position()`` / ``restore(position)`` are plain dicts (``prompt_batches_used``, ``prompt_epoch``,
    ``epoch_start``): a restored stream fast-forwards a fresh pass to where it was. The sampler is
    told the pass number (``set_epoch``) before each pass, which Lightning cannot do inside one
    endless epoch: the datamodules' samplers (one rank or several) order pass ``e`` as a function of
    ``(seed, e)`` only, so each pass is reshuffled and a restored stream replays the order of the
    pass it was in, yielding exactly the records of that pass it had not handed out yet.
    """

    def __init__(self, prompts: Iterable[list[dict[str, Any]]]) -> None:
        self.prompts = prompts
        self.batches_used = 0
        self.epoch = 0
        self.epoch_start = 0  # batches_used when the current pass began
        self.replay: list[list[dict[str, Any]]] = []  # records to relaunch first after a resume
        self._iter: Iterator[list[dict[str, Any]]] | None = None

    def next_records(self) -> list[dict[str, Any]]:
        if self.replay:
            return self.replay.pop(0)
        if self._iter is None:
            self._iter = self._new_pass()
            for _ in range(self.batches_used - self.epoch_start):
                next(self._iter)
        try:
            records = next(self._iter)
        except StopIteration:  # a new pass over the prompts (launches run ahead of Lightning's epoch)
            self.epoch += 1
            self.epoch_start = self.batches_used
            self._iter = self._new_pass()
            records = next(self._iter)
        self.batches_used += 1
        return list(records)

    def _new_pass(self) -> Iterator[list[dict[str, Any]]]:
        set_epoch = getattr(getattr(self.prompts, "sampler", None), "set_epoch", None)  # (as Lightning does)
        if callable(set_epoch):
            set_epoch(self.epoch)
        return iter(self.prompts)

    def batches_per_pass(self) -> int:
        """The prompt batches of one pass (the train dataloader's length): a Lightning epoch's steps.
        ``TypeError`` when the prompts have no length (Lightning then sees one endless epoch)."""
        return len(self.prompts)  # type: ignore[arg-type]

    def position(self) -> dict[str, int]:
        return {
            "prompt_batches_used": self.batches_used,
            "prompt_epoch": self.epoch,
            "epoch_start": self.epoch_start,
        }

    def restore(self, position: dict[str, Any], replay: list[list[dict[str, Any]]]) -> None:
        self.batches_used = position["prompt_batches_used"]
        self.epoch = position["prompt_epoch"]
        self.epoch_start = position["epoch_start"]
        self.replay = [list(records) for records in replay]
        self._iter = None
