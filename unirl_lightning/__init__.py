"""unirl_lightning: async RL post-training (GRPO, PPO, Flow-GRPO) the Lightning way.

The public API is re-exported here lazily, so that ``import unirl_lightning.rollout.controller``
(the driver-side bookkeeping) never pulls in torch or ray::

    from unirl_lightning import AsyncRolloutStrategy, GRPOModule, PromptDataModule
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
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
    "export_checkpoint": "unirl_lightning.models.export",
    "export_policy": "unirl_lightning.models.export",
    # data
    "PromptDataModule": "unirl_lightning.data",
    "ImagePromptDataModule": "unirl_lightning.data",
    # policies
    "TinyCausalLM": "unirl_lightning.models.causal_lm",
    "PretrainedCausalLM": "unirl_lightning.models.causal_lm",
    "TinyFlowModel": "unirl_lightning.models.diffusion",
    "SD3FlowModel": "unirl_lightning.models.diffusion",
    "LoraSpec": "unirl_lightning.models.lora",
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
    "ReasoningGymReward": "unirl_lightning.rewards",
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


# Modules that moved into the layer folders, by their former path: ``unirl_lightning.preflight`` (or a
# YAML ``class_path: unirl_lightning.models_diffusion.TinyFlowModel``, or a pickled checkpoint naming
# ``unirl_lightning.checkpoint_io``) imports the module at its new home, the same module object.
MOVED: dict[str, str] = {
    "seeding": "core.seeding",
    "imports": "core.imports",
    "checks": "core.checks",
    "cli_types": "core.types",
    "timeline": "core.timeline",
    "prompts": "core.prompts",
    "preflight": "core.preflight",
    "sharding": "distributed.sharding",
    "meta_init": "distributed.meta_init",
    "abort": "distributed.abort",
    "checkpoint_io": "strategy.checkpoint_io",
    "ray_watchdog": "workers.watchdog",
    "plan": "planning.plan",
    "plan_memory": "planning.memory",
    "models_diffusion": "models.diffusion",
    "lora": "models.lora",
    "export": "models.export",
    "cli_config": "cli.config",
    "cli_errors": "cli.errors",
    "cli_plan": "cli.plan",
    "demo": "cli.demo",
    "tb": "cli.curves",
    "rollout.agentic": "agentic.controller",
    "rollout.agentic_loop": "agentic.loop",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves a former module path of :data:`MOVED` to the module where it lives now."""

    prefix = __name__ + "."

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.startswith(self.prefix) and fullname[len(self.prefix) :] in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module(self.prefix + MOVED[spec.name[len(self.prefix) :]])

    def exec_module(self, module: Any) -> None:  # the module ran where it lives
        return None


if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(MovedModuleFinder())
