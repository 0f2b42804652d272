"""Policy specs and what is done with a policy's weights outside training.

* :mod:`~unirl_lightning.models.causal_lm`: causal LM specs (``TinyCausalLM``, ``PretrainedCausalLM``);
* :mod:`~unirl_lightning.models.gguf`: local GGUF files (the bundled SmolLM2) as a policy's weights;
* :mod:`~unirl_lightning.models.diffusion`: diffusion specs (``TinyFlowModel``, ``SD3FlowModel``);
* :mod:`~unirl_lightning.models.lora`: LoRA adapters through ``peft``;
* :mod:`~unirl_lightning.models.export`: a checkpoint's policy in the Hugging Face layout.

``unirl_lightning.models.TinyCausalLM`` (a ``class_path`` recipes use) and the other names of the
former ``models`` module resolve here, lazily, so importing a sibling never imports transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_FORMER_MODULE = ("unirl_lightning.models.causal_lm", "unirl_lightning.models.gguf")


def __getattr__(name: str) -> Any:
    if not name.startswith("__"):
        for path in _FORMER_MODULE:
            module = importlib.import_module(path)
            if hasattr(module, name):
                return getattr(module, name)
    raise AttributeError(f"module 'unirl_lightning.models' has no attribute {name!r}")
