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
    # the strategy and the modules
    "AsyncRolloutStrategy": "unirl_lightning.strategy",
    "AsyncRolloutDDPStrategy": "unirl_lightning.strategy",
    "AsyncRolloutFSDPStrategy": "unirl_lightning.strategy",
    "GRPOModule": "unirl_lightning.modules",
    "AgenticGRPOModule": "unirl_lightning.modules",
    "PPOModule": "unirl_lightning.modules",
    "FlowGRPOModule": "unirl_lightning.modules",
    "PolicyGradientModule": "unirl_lightning.modules",
    "RLModule": "unirl_lightning.modules",
    "RolloutSpec": "unirl_lightning.modules",
    # callbacks
    "WeightSyncCallback": "unirl_lightning.callbacks",
    "RolloutEvalCallback": "unirl_lightning.callbacks",
    "WeightVersionLogger": "unirl_lightning.callbacks",
    "SampleImageLogger": "unirl_lightning.callbacks",
    "ExportOnTrainEnd": "unirl_lightning.callbacks",
    "CompletionLogger": "unirl_lightning.callbacks",
    "TimelineWriter": "unirl_lightning.callbacks",
    # export a checkpoint's policy in the Hugging Face layout
    "export_checkpoint": "unirl_lightning.export",
    "export_policy": "unirl_lightning.export",
    # data
    "PromptDataModule": "unirl_lightning.data",
    "ImagePromptDataModule": "unirl_lightning.data",
    # policies
    "TinyCausalLM": "unirl_lightning.models",
    "PretrainedCausalLM": "unirl_lightning.models",
    "TinyFlowModel": "unirl_lightning.models_diffusion",
    "SD3FlowModel": "unirl_lightning.models_diffusion",
    "LoraSpec": "unirl_lightning.lora",
    # serving (the strategy's engine=) and weight sync (its weight_sync=)
    "HFEngineConfig": "unirl_lightning.engines.hf",
    "VLLMEngineConfig": "unirl_lightning.engines.vllm",
    "SGLangEngineConfig": "unirl_lightning.engines.sglang",
    "DiffusionEngineConfig": "unirl_lightning.engines.diffusion",
    "ObjectStoreWeightSync": "unirl_lightning.weight_sync",
    "CollectiveWeightSync": "unirl_lightning.weight_sync",
    # rewards
    "ExactMatchReward": "unirl_lightning.rewards",
    "MathVerifyReward": "unirl_lightning.rewards",
    "CallableReward": "unirl_lightning.rewards",
    "FormatReward": "unirl_lightning.rewards",
    "CombinedReward": "unirl_lightning.rewards",
    "CodeExecutionReward": "unirl_lightning.rewards",
    "RemoteReward": "unirl_lightning.rewards",
    # the records a custom module trains on
    "ExperienceBatch": "unirl_lightning.rollout.batches",
    "DiffusionBatch": "unirl_lightning.rollout.batches",
    "SamplingParams": "unirl_lightning.rollout.records",
    "DiffusionSampling": "unirl_lightning.rollout.records",
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
