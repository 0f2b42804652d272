"""LightningModules for RL post-training (manual optimization) on one policy-gradient base."""

from unirl_lightning.modules.agentic_grpo import AgenticGRPOModule
from unirl_lightning.modules.base import PolicyGradientModule, RLModule
from unirl_lightning.modules.causal_lm import CausalLMModule
from unirl_lightning.modules.flow_grpo import FlowGRPOModule
from unirl_lightning.modules.grpo import GRPOModule
from unirl_lightning.modules.ppo import PPOModule
from unirl_lightning.modules.spec import RolloutSpec

__all__ = [
    "AgenticGRPOModule",
    "CausalLMModule",
    "FlowGRPOModule",
    "GRPOModule",
    "PPOModule",
    "PolicyGradientModule",
    "RLModule",
    "RolloutSpec",
]
