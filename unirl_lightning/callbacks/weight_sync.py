"""When to push the trainer's weights to the rollout workers."""

from __future__ import annotations

from typing import Any

from unirl_lightning.callbacks.base import RolloutCallback
from unirl_lightning.core.checks import require_at_least
from unirl_lightning.core.types import PositiveInt


class WeightSyncCallback(RolloutCallback):
    """Push weights every ``every_n_steps`` RL steps: quiesce, push, version + 1.

    The push itself is the strategy's one verb, ``sync_weights`` (quiesce, push, advance the version);
    the cadence is this callback's: :meth:`push_due` pushes once at a step it is due, whoever asks
    first (this callback's ``on_train_batch_end``, or an evaluation that must score the step's update,
    in whatever order the callbacks run), and :meth:`push_trained` pushes the last update unless the
    workers hold it. The cadence is handed to the strategy in ``setup`` (the launch ceiling uses it,
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

    def push_due(self) -> dict[str, float] | None:
        """The push due at this RL step (every ``every_n_steps`` steps), done once whoever asks first.
        Returns the push's stats (the same on a second call at this step), or None when no push is due.
        Every rank calls it at the same point (the push is collective)."""
        step = self.strategy.rl_steps
        if step % self.every_n_steps:
            return None
        if self.strategy.pushed_step != step:
            self.strategy.sync_weights()
        return self.strategy.last_sync

    def push_trained(self) -> dict[str, float] | None:
        """Push unless the workers already hold the last RL step's update (an evaluation at the end of
        training scores the final weights); None when they do. Collective, like every push."""
        step = self.strategy.rl_steps
        if step == 0 or self.strategy.pushed_step == step:
            return None
        return self.strategy.sync_weights()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stats = self.push_due()  # an evaluation listed before this callback may have pushed
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


def weight_sync_callback(trainer: Any) -> WeightSyncCallback:
    """The trainer's :class:`WeightSyncCallback` (RL modules add one when the trainer has none): the one
    place that decides when the workers get the trainer's weights."""
    for callback in trainer.callbacks:
        if isinstance(callback, WeightSyncCallback):
            return callback
    raise RuntimeError(
        "no WeightSyncCallback on the trainer: RL modules add one in configure_callbacks; "
        "a module that overrides configure_callbacks must keep it (or pass WeightSyncCallback() in callbacks)"
    )
