"""Sample images before and after training, from the rollout workers (read-only)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from unirl_lightning.callbacks.base import RolloutCallback
from unirl_lightning.core.checks import require_at_least


class SampleImageLogger(RolloutCallback):
    """Log ``num_images`` images sampled with the deterministic ODE at fixed seeds, at the start and
    the end of training, as ``samples/before`` and ``samples/after`` (TensorBoard).

    The images come from the workers' current weights through the strategy's read-only
    ``evaluate`` (no push, no version change), from the datamodule's ``val_records()`` (else
    ``train_records()``). They are also kept in ``self.images`` (``uint8 [k, H, W, 3]`` by tag).
    ``FlowGRPOModule`` adds one when the trainer has none.

    Example::

        Trainer(strategy=AsyncRolloutStrategy(max_inflight=1), callbacks=[SampleImageLogger(num_images=4)])
    """

    def __init__(self, num_images: int = 8) -> None:
        self.num_images = require_at_least("num_images", num_images, 0)
        self.images: dict[str, torch.Tensor] = {}

    def _records(self, trainer: Any) -> list[dict[str, Any]]:
        datamodule = trainer.datamodule
        for source in ("val_records", "train_records"):
            records = list(getattr(datamodule, source, lambda: [])() or [])
            if records:
                return records[: self.num_images]
        return [{"prompt": ""}]

    def log_samples(self, trainer: Any, pl_module: Any, tag: str) -> None:
        if not self.num_images or not trainer.is_global_zero:
            return
        records = self._records(trainer)
        per_record = math.ceil(self.num_images / len(records))
        groups = self.strategy.evaluate(records, pl_module.eval_sampling(0.0), n=per_record, seed=0)
        images = torch.from_numpy(np.stack([r.image for g in groups for r in g][: self.num_images]))
        self.images[tag] = images
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_images(
                    f"samples/{tag}", images, trainer.global_step, dataformats="NHWC"
                )

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.log_samples(trainer, pl_module, "before")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.log_samples(trainer, pl_module, "after")
