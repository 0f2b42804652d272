"""The base of the rollout callbacks: they read the strategy; the strategy never imports them."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from unirl_lightning.strategy import RolloutStrategyMixin


class RolloutCallback(Callback):
    """A callback that needs a rollout strategy (:class:`~unirl_lightning.strategy.AsyncRolloutStrategy`
    or a sibling such as ``AsyncRolloutDDPStrategy``).

    ``setup`` checks the trainer's strategy once and keeps it as ``self.strategy``; a trainer with
    another strategy fails there with a message naming the callback.
    """

    strategy: RolloutStrategyMixin

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, RolloutStrategyMixin):
            raise RuntimeError(
                f"{type(self).__name__} needs Trainer(strategy=AsyncRolloutStrategy(...)) (YAML: "
                f"trainer.strategy.class_path: unirl_lightning.strategy.AsyncRolloutStrategy), got "
                f"{type(strategy).__name__}"
            )
        self.strategy = strategy
