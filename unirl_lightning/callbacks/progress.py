"""Lightning's progress bars, counting RL steps.

``trainer.max_steps`` and ``trainer.global_step`` count RL steps (one rollout batch each, whatever its
``ppo_epochs x mini_batches`` optimizer steps: ``PolicyGradientModule.take_optimizer_step``), and the
rollout loop is one endless epoch. These bars show ``RL step k/K`` (``K = max_steps``, counted over
the whole run, also after a resume) and the logged metrics without ``v_num``.
``RLModule.configure_callbacks`` swaps Lightning's default bar for the matching one here.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar


class _RLStepCount:
    """What both bars share: the total, the position and the description in RL steps."""

    @property
    def total_train_batches(self) -> int | float:
        max_steps = self.trainer.max_steps
        if max_steps is None or max_steps < 0:
            return float("inf")
        return max_steps

    @property
    def train_description(self) -> str:
        return "RL step"

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # the bars show batch_idx + 1: pass the RL steps done over the whole run instead
        super().on_train_batch_end(trainer, pl_module, outputs, batch, trainer.global_step - 1)


class RLProgressBar(_RLStepCount, TQDMProgressBar):
    """Lightning's TQDM bar counting RL steps (see the module docstring)."""

    def on_train_epoch_start(self, trainer: Any, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(self.train_description)


class RLRichProgressBar(_RLStepCount, RichProgressBar):
    """Lightning's rich bar counting RL steps (see the module docstring)."""

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, description=self.train_description)
