"""unirl_lightning: async RL post-training (GRPO, PPO, Flow-GRPO) the Lightning way.

The public API is re-exported here lazily, so that ``import unirl_lightning.rollout.controller``
(the driver-side bookkeeping) never pulls in torch or ray::

    from unirl_lightning import AsyncRolloutStrategy, GRPOModule, PromptDataModule
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncRolloutStrategy": "unirl_lightning.strategy",
    "GRPOModule": "unirl_lightning.modules",
    "PPOModule": "unirl_lightning.modules",
    "RLModule": "unirl_lightning.modules",
    "RolloutSpec": "unirl_lightning.modules",
    "WeightSyncCallback": "unirl_lightning.callbacks",
    "RolloutEvalCallback": "unirl_lightning.callbacks",
    "WeightVersionLogger": "unirl_lightning.callbacks",
    "PromptDataModule": "unirl_lightning.data",
    "HFEngineConfig": "unirl_lightning.engines.hf",
    "TinyCausalLM": "unirl_lightning.models",
    "PretrainedCausalLM": "unirl_lightning.models",
    "ObjectStoreWeightSync": "unirl_lightning.weight_sync",
    "CollectiveWeightSync": "unirl_lightning.weight_sync",
    "RolloutWorkerGroup": "unirl_lightning.workers",
    "BatchRolloutController": "unirl_lightning.rollout.controller",
    "AgenticRolloutController": "unirl_lightning.rollout.agentic",
    "launch_ceiling": "unirl_lightning.rollout.controller",
    "RolloutLoop": "unirl_lightning.rollout.loop",
    "Rollout": "unirl_lightning.rollout.types",
    "RolloutRequest": "unirl_lightning.rollout.types",
    "ExperienceBatch": "unirl_lightning.rollout.types",
    "SamplingParams": "unirl_lightning.rollout.types",
    "ExactMatchReward": "unirl_lightning.rewards",
    "MathVerifyReward": "unirl_lightning.rewards",
    "CallableReward": "unirl_lightning.rewards",
    "FormatReward": "unirl_lightning.rewards",
    "CombinedReward": "unirl_lightning.rewards",
    "FlowGRPOModule": "unirl_lightning.modules.flow_grpo",
    "ImagePromptDataModule": "unirl_lightning.modules.flow_grpo",
    "DiffusionBatch": "unirl_lightning.modules.flow_grpo",
    "DiffusionEngineConfig": "unirl_lightning.engines.diffusion",
    "DiffusionSampling": "unirl_lightning.engines.diffusion",
    "TinyFlowModel": "unirl_lightning.models_diffusion",
    "SD3FlowModel": "unirl_lightning.models_diffusion",
    "LoraSpec": "unirl_lightning.lora",
    "VLLMEngineConfig": "unirl_lightning.engines.vllm",
    "SGLangEngineConfig": "unirl_lightning.engines.sglang",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'unirl_lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
