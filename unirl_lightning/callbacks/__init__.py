"""Callbacks that decide *when* rollout-side things happen; the strategy does them."""

from unirl_lightning.callbacks.eval import RolloutEvalCallback
from unirl_lightning.callbacks.version_logger import WeightVersionLogger
from unirl_lightning.callbacks.weight_sync import WeightSyncCallback

__all__ = ["RolloutEvalCallback", "WeightSyncCallback", "WeightVersionLogger"]
