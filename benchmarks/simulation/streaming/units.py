"""The simulator's units of work: a :class:`Group` (one prompt x ``samples`` rows, what is launched,
reaped and trained) and its :class:`Row` s (one sample each: its target length, its progress, and the
weight version of each run of its tokens). Standard library only."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.simulation.streaming import Engine


class Row:
    __slots__ = ("group", "target", "tokens", "mark", "finish", "segments", "cancelled", "state")

    def __init__(self, group: Group, target: int) -> None:
        self.group, self.target = group, target
        self.tokens = 0  # tokens generated up to engine step `mark`
        self.mark = 0
        self.finish = 0  # the engine step at which the row ends
        self.segments: list[list[int]] = []
        self.cancelled = False
        self.state = 0  # 0 queued, 1 active, 2 finished

    def close(self, step: int, version: int) -> None:
        """Record the tokens generated since ``mark`` as made under ``version``."""
        n = step - self.mark
        if n > 0:
            if self.segments and self.segments[-1][0] == version:
                self.segments[-1][1] += n
            else:
                self.segments.append([version, n])
            self.tokens += n
        self.mark = step


class Group:
    def __init__(self, gen_id: int, targets: list[int], prompt_len: int) -> None:
        self.gen_id, self.prompt_len = gen_id, prompt_len
        self.rows = [Row(self, t) for t in targets]
        self.remaining = len(targets)
        self.engine: Engine | None = None
        self.prefilled = False
        self.done_at: float | None = None

    def tokens(self) -> int:
        """Prompt and completion tokens of the group (what the trainer processes)."""
        return sum(self.prompt_len + r.target for r in self.rows)
