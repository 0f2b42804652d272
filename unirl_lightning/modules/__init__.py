"""LightningModules for RL post-training (manual optimization)."""

from unirl_lightning.modules.base import RLModule, RolloutSpec
from unirl_lightning.modules.grpo import GRPOModule
from unirl_lightning.modules.ppo import PPOModule

__all__ = ["GRPOModule", "PPOModule", "RLModule", "RolloutSpec"]
