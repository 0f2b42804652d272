"""Writes the runtime's timeline (``timeline.json``, a Chrome trace) into the run's log folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from unirl_lightning.callbacks.base import RolloutCallback
from unirl_lightning.core.checks import require_at_least


class TimelineWriter(RolloutCallback):
    """Write the pipeline's timeline (:mod:`unirl_lightning.core.timeline`) every ``every_n_steps`` RL
    steps, at the end of ``fit`` and when it fails, atomically, into the run's log folder
    (``trainer.log_dir``; nothing is written by a run without a logger, as with ``placement.json``):
    ``timeline.json`` for rank 0, ``timeline.rank{r}.json`` for the others. Open it in ``chrome://tracing`` or Perfetto, or draw
    it with :func:`unirl_lightning.core.timeline.gantt`. RL modules add one when the trainer has none.

    Example::

        Trainer(strategy=AsyncRolloutStrategy(), callbacks=[TimelineWriter(every_n_steps=50)])
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        self.every_n_steps = require_at_least("every_n_steps", every_n_steps, 1)
        self.path: Path | None = None
        self._timeline: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        folder = trainer.log_dir if trainer.loggers else None  # a collective (every rank is here)
        rank = trainer.global_rank
        name = "timeline.json" if rank == 0 else f"timeline.rank{rank}.json"
        self.path = Path(folder) / name if folder else None
        runtime = self.strategy.runtime
        self._timeline = runtime.timeline if runtime is not None else None  # kept past a shutdown

    def write(self) -> Path | None:
        if self._timeline is None or self.path is None:
            return None
        return self._timeline.write(self.path)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.strategy.rl_steps % self.every_n_steps == 0:
            self.write()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.write()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.write()
