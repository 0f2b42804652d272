"""LoRA through ``peft``, shared by LLM and diffusion policies and by every engine.

Contract: the trainer and each engine wrap the same base model with :func:`apply_lora` from the same
:class:`LoraSpec` (same targets, same seeded ``lora_A`` init, ``lora_B = 0``), so before any push
both compute with the base weights. A push then carries adapter tensors only
(``get_peft_model_state_dict`` names, see ``weight_sync.named_weights``), loaded with
:func:`load_named_weights`. :func:`effective_weights` gives the weights a model computes with
(adapters merged in) for equality checks.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from unirl_lightning.core.seeding import global_seed

# attention and MLP projections of Llama/Qwen-style decoders
LLM_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters (``peft``); only adapter tensors are trained and synced.

    Args:
        rank / alpha: adapter rank and scaling (``alpha / rank``).
        target_modules: module-name suffixes to adapt; None = the architecture's default
            (LLMs: attention and MLP projections; SD3: the attention projections, as in Flow-GRPO;
            UNet: the ResNet convs and time projections).
        init_seed: seed of the adapters' random initialisation (``lora_A``; ``lora_B`` starts at 0),
            the same in the trainer and every engine. None = the seed of ``seed_everything`` when the
            module is built (see :meth:`resolved`), else 0.

    Example::

        GRPOModule(policy=PretrainedCausalLM("Qwen/Qwen2.5-0.5B-Instruct"), lora=LoraSpec(rank=16, alpha=32))
    """

    rank: int = 4
    alpha: float = 8.0
    target_modules: tuple[str, ...] | None = None
    init_seed: int | None = None

    def resolved(self) -> LoraSpec:
        """This spec with a concrete ``init_seed`` (the global seed where it is None), so that the
        engines, built in other processes from the spec, draw the trainer's adapters."""
        return self if self.init_seed is not None else replace(self, init_seed=global_seed())

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoraSpec rank must be >= 1, got {self.rank}")
        if self.target_modules is not None:
            object.__setattr__(self, "target_modules", tuple(self.target_modules))


def apply_lora(model: torch.nn.Module, lora: LoraSpec, default_targets: Iterable[str]) -> torch.nn.Module:
    """Wrap ``model`` in a ``peft`` model with fresh adapters (deterministic init: B = 0)."""
    from peft import LoraConfig, get_peft_model

    targets = list(lora.target_modules or default_targets)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets, lora_dropout=0.0)
    seed = lora.resolved().init_seed  # lora_A is random: trainer and workers draw the same one
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model under a PEFT wrapper (the model itself when it has none)."""
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


def effective_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights ``model`` computes with, by the base model's names (LoRA merged in)."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        model = copy.deepcopy(model).merge_and_unload()
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def load_named_weights(
    model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], lora: LoraSpec | None
) -> None:
    """Load a push into an engine's model: adapter tensors when it runs LoRA, else full weights."""
    named = dict(named_tensors)
    if lora is not None:
        from peft import set_peft_model_state_dict

        full = [name for name in named if ".lora_" not in name]
        if full:
            raise KeyError(
                f"this engine runs LoRA and takes adapter tensors only, got non-adapter weights {full[:3]}"
            )
        result = set_peft_model_state_dict(model, named)
        if result.unexpected_keys:
            raise KeyError(f"adapter weights {result.unexpected_keys[:3]} are not in the engine's adapter")
        return
    params = model.state_dict(keep_vars=True)  # every name, tied aliases included
    with torch.no_grad():
        for name, tensor in named.items():
            if name not in params:
                raise KeyError(f"weight {name!r} is not a parameter of the engine's model")
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))


def share_named_weights(
    model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> tuple[int, int]:
    """Give an in-process engine's ``model`` the trainer's tensors (full weights, by name): each
    parameter of the same dtype, device and shape takes the trainer's tensor itself (the two share
    storage: no copy), every other one is copied in place, cast. Returns ``(bytes copied, tensors
    shared)``. The caller guarantees the engine only reads them, and only while the trainer does not
    write them."""
    params = model.state_dict(keep_vars=True)  # every name, tied aliases included
    copied = shared = 0
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"weight {name!r} is not a parameter of the engine's model")
            target = params[name]
            if (target.dtype, target.device, target.shape) == (tensor.dtype, tensor.device, tensor.shape):
                target.data = tensor.detach()
                shared += 1
            else:
                target.copy_(tensor.to(target.device, target.dtype))
                copied += target.numel() * target.element_size()
    return copied, shared


def is_lora_push(items: list[tuple[str, torch.Tensor]]) -> bool:
    """True for an adapter-only push, False for full weights; a mix of both is an error."""
    lora = sum(1 for name, _ in items if ".lora_A." in name or ".lora_B." in name)
    if lora and lora != len(items):
        raise ValueError(
            f"a weight push is either full weights or LoRA adapter tensors only; got {lora} adapter and "
            f"{len(items) - lora} other tensors"
        )
    return bool(lora)
