"""Logs the weight version and the staleness of what was trained."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger

from unirl_lightning.callbacks.base import RolloutCallback
from unirl_lightning.core.checks import require_at_least


class WeightVersionLogger(RolloutCallback):
    """Log ``rollout/weight_version``, ``rollout/staleness_mean``, ``rollout/staleness_max`` every step,
    and a staleness histogram (TensorBoard) every ``histogram_every_n_steps``.

    Staleness of a trained row = the version it was trained under - the version it was launched
    under. It is measured at ``on_train_batch_start``, before this step's sync. RL modules add one
    when the trainer has none.

    Example::

        Trainer(strategy=AsyncRolloutStrategy(), callbacks=[WeightVersionLogger(histogram_every_n_steps=10)])
    """

    def __init__(self, histogram_every_n_steps: int = 10, prog_bar: bool = True) -> None:
        self.histogram_every_n_steps = require_at_least("histogram_every_n_steps", histogram_every_n_steps, 0)
        self.prog_bar = prog_bar

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        version = self.strategy.weight_version
        staleness = (version - batch.weight_versions).float()
        sync = trainer.world_size > 1  # the same version on every rank; staleness over all ranks
        pl_module.log("rollout/weight_version", float(version), prog_bar=self.prog_bar, batch_size=1)
        pl_module.log("rollout/staleness_mean", staleness.mean(), batch_size=1, sync_dist=sync)
        pl_module.log("rollout/staleness_max", staleness.max(), batch_size=1, sync_dist=sync, reduce_fx="max")
        every = self.histogram_every_n_steps
        if every and batch_idx % every == 0:
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_histogram("rollout/staleness", staleness, trainer.global_step)
