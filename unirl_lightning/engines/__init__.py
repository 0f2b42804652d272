"""Inference engines that run inside rollout workers.

``"hf"`` (``transformers``, the embedded default, CPU or GPU), ``"vllm"`` and ``"sglang"`` (extras);
``"diffusion"`` for flow-matching image models. :func:`resolve_engine_config` turns a name into a
default config; engine modules import their backend lazily, so naming one that is not installed
fails when the worker builds it, with the extra to install.
"""

from __future__ import annotations

import importlib
from typing import Any

ENGINES = {
    "hf": ("unirl_lightning.engines.hf", "HFEngineConfig"),
    "vllm": ("unirl_lightning.engines.vllm", "VLLMEngineConfig"),
    "sglang": ("unirl_lightning.engines.sglang", "SGLangEngineConfig"),
}


def resolve_engine_config(spec: Any) -> Any:
    """An engine config instance from a name (``"hf"``, ``"vllm"``, ``"sglang"``) or a config itself."""
    if not isinstance(spec, str):
        return spec
    if spec not in ENGINES:
        raise ValueError(
            f"unknown engine {spec!r}: choose one of {sorted(ENGINES)} (vllm needs "
            "pip install 'unirl-lightning[vllm]', sglang needs pip install 'unirl-lightning[sglang]')"
        )
    module, name = ENGINES[spec]
    return getattr(importlib.import_module(module), name)()
