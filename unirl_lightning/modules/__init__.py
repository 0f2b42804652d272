"""LightningModules for RL post-training (manual optimization)."""

from unirl_lightning.modules.base import RLModule, RolloutSpec
from unirl_lightning.modules.grpo import GRPOModule

__all__ = ["GRPOModule", "RLModule", "RolloutSpec"]
