"""What the serving engines (vLLM, SGLang) share: how a policy spec becomes a model directory they
load, and how a LoRA push becomes a PEFT adapter they register.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from unirl_lightning.models.causal_lm import PolicySpec, PretrainedCausalLM, TinyCausalLM
from unirl_lightning.models.lora import LoraSpec

__all__ = ["ServedPolicy", "lora_adapter_config", "materialize_policy"]

_LORA_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<kind>A|B)(?:\.[^.]+)?\.weight$")


def lora_adapter_config(tensors: dict[str, torch.Tensor], lora: LoraSpec, base_model: str) -> dict[str, Any]:
    """The PEFT ``adapter_config.json`` of adapter tensors (rank and target modules read off them)."""
    modules: set[str] = set()
    ranks: set[int] = set()
    for name in tensors:
        match = _LORA_NAME.match(name)
        if match is None:
            raise ValueError(
                f"weight {name!r} is not a LoRA adapter tensor (expected '<module>.lora_A.weight' or "
                "'<module>.lora_B.weight', the names get_peft_model_state_dict gives)"
            )
        modules.add(match["module"].rsplit(".", 1)[-1])
        if match["kind"] == "A":
            ranks.add(int(tensors[name].shape[0]))
    if ranks != {lora.rank}:
        raise ValueError(
            f"the pushed adapter has rank {sorted(ranks)}, the engine was configured with lora.rank={lora.rank}"
        )
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": sorted(modules),
    }


@dataclass
class ServedPolicy:
    """A policy as a serving engine loads it: a local directory or hub id, its dtype, its tokenizer."""

    path: str
    dtype: str
    trust_remote_code: bool
    tokenizer: Any


def materialize_policy(policy: PolicySpec, directory: str) -> ServedPolicy:
    """What a serving engine needs to load ``policy``: a :class:`PretrainedCausalLM` from its
    ``pretrained_path()`` (a hub id, a directory, or the cached float copy of a GGUF file); a
    :class:`TinyCausalLM` built and saved (``save_pretrained``, model + tokenizer) under ``directory``."""
    if isinstance(policy, PretrainedCausalLM):
        from transformers import AutoTokenizer

        path = policy.pretrained_path()
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=policy.trust_remote_code)
        return ServedPolicy(path, policy.dtype, policy.trust_remote_code, tokenizer)
    if isinstance(policy, TinyCausalLM):
        model, tokenizer = policy.build()
        path = os.path.join(directory, "policy")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        return ServedPolicy(path, "float32", False, tokenizer)
    raise TypeError(
        f"serving engines build TinyCausalLM or PretrainedCausalLM policies, got {type(policy).__name__}"
    )


def check_checkpoint_names(served: ServedPolicy, engine: str) -> None:
    """Refuse to serve a policy whose pushed weights would not carry the checkpoint's names
    (:func:`~unirl_lightning.core.device_rules.checkpoint_names_error`); reads the served ``config.json``."""
    from transformers import AutoConfig

    from unirl_lightning.core.device_rules import checkpoint_names_error, renamed_by_transformers

    model_type = str(
        AutoConfig.from_pretrained(served.path, trust_remote_code=served.trust_remote_code).model_type
    )
    error = checkpoint_names_error(model_type, renamed_by_transformers(model_type), engine)
    if error is not None:
        raise ValueError(error)
