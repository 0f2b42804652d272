"""Logs the weight version and the staleness of what was trained."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from unirl_lightning.callbacks._util import rollout_strategy


class WeightVersionLogger(Callback):
    """Log ``rollout/weight_version``, ``rollout/staleness_mean``, ``rollout/staleness_max`` every step,
    and a staleness histogram (TensorBoard) every ``histogram_every_n_steps``.

    Staleness of a trained row = the version it was trained under - the version it was launched
    under. It is measured at ``on_train_batch_start``, before this step's sync.

    Example::

        Trainer(strategy=AsyncRolloutStrategy(), callbacks=[WeightVersionLogger(histogram_every_n_steps=10)])
    """

    def __init__(self, histogram_every_n_steps: int = 10, prog_bar: bool = True) -> None:
        if histogram_every_n_steps < 0:
            raise ValueError(
                f"histogram_every_n_steps must be >= 0 (0 = never), got {histogram_every_n_steps}"
            )
        self.histogram_every_n_steps = histogram_every_n_steps
        self.prog_bar = prog_bar
        self.max_staleness_seen = 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        strategy = rollout_strategy(trainer, type(self).__name__)
        version = strategy.weight_version
        staleness = (version - batch.weight_versions).float()
        self.max_staleness_seen = max(self.max_staleness_seen, int(staleness.max()))
        pl_module.log("rollout/weight_version", float(version), prog_bar=self.prog_bar, batch_size=1)
        pl_module.log_dict(
            {"rollout/staleness_mean": staleness.mean(), "rollout/staleness_max": staleness.max()},
            batch_size=1,
        )
        every = self.histogram_every_n_steps
        if every and batch_idx % every == 0:
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_histogram("rollout/staleness", staleness, trainer.global_step)
