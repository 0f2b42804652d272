"""When to push the trainer's weights to the rollout workers."""

from __future__ import annotations

from typing import Any

from unirl_lightning.callbacks.base import RolloutCallback
from unirl_lightning.checks import require_at_least
from unirl_lightning.cli_types import PositiveInt


class WeightSyncCallback(RolloutCallback):
    """Push weights every ``every_n_steps`` RL steps: quiesce, push, version + 1.

    The push itself is the strategy's ``sync_weights`` (it refuses while anything is in flight, so it
    quiesces first). The cadence is handed to the strategy in ``setup`` (the launch ceiling uses it,
    so the staleness bound holds for any cadence). After a resume the workers are re-pushed once at
    train start so they hold the restored weights. Logs ``sync/time_s``, ``sync/bytes`` and
    ``sync/quiesce_s``. RL modules add one with the default cadence when the trainer has none.

    Args:
        every_n_steps: RL steps (training batches) between pushes.

    Example::

        Trainer(strategy=AsyncRolloutStrategy(), callbacks=[WeightSyncCallback(every_n_steps=2)])
    """

    def __init__(self, every_n_steps: PositiveInt = 1) -> None:
        self.every_n_steps = int(require_at_least("every_n_steps", every_n_steps, 1))
        self.num_syncs = 0
        self._resumed = False

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self.strategy.sync_interval = self.every_n_steps

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._resumed:
            self.strategy.sync_weights()
            self._resumed = False

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = self.strategy.sync_for_step()  # an evaluation listed before this callback may have pushed
        if stats is None:
            return
        self.num_syncs += 1
        # the slowest rank's times (a sync ends when every rank is done)
        sync = trainer.world_size > 1
        pl_module.log_dict(stats, on_step=True, on_epoch=False, batch_size=1, sync_dist=sync, reduce_fx="max")

    def state_dict(self) -> dict[str, Any]:
        return {"every_n_steps": self.every_n_steps, "num_syncs": self.num_syncs}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.num_syncs = int(state_dict["num_syncs"])
        self._resumed = True
