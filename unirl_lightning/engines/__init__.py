"""Inference engines that run inside rollout workers; the strategy chooses one.

``"hf"`` (``transformers``, the embedded default for token policies, CPU or GPU), ``"vllm"`` and
``"sglang"`` (extras), ``"diffusion"`` (flow-matching image models). An :class:`EngineConfig` says
*how* to serve; it builds its engine from the module's policy spec and LoRA spec
(``config.build(policy, lora)``) inside the worker. Engine modules import their backend lazily, so
naming one that is not installed fails when the worker builds it, with the extra to install.
"""

from unirl_lightning.engines.base import (
    ENGINES,
    EngineConfig,
    EngineName,
    RolloutEngine,
    check_engine_name,
    engine_name,
    resolve_engine,
)

__all__ = [
    "ENGINES",
    "EngineConfig",
    "EngineName",
    "RolloutEngine",
    "check_engine_name",
    "engine_name",
    "resolve_engine",
]
