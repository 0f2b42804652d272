"""The arguments SGLang's engine is built with, as pure functions (no SGLang import): the engine's
``sglang.Engine(**kwargs)`` and each request's ``sampling_params``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from unirl_lightning.models.lora import LoraSpec
from unirl_lightning.rollout.records import SamplingParams

if TYPE_CHECKING:
    from unirl_lightning.engines.serving import ServedPolicy

__all__ = ["OWNED_SAMPLING_KEYS", "sglang_engine_kwargs", "sglang_sampling_params"]

OWNED_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "skip_special_tokens",
    "sampling_seed",
    "n",
)


def sglang_sampling_params(
    sampling: SamplingParams,
    stop_ids: list[int],
    seed: int | None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One request's SGLang ``sampling_params`` for ``sampling`` (``seed``: deterministic mode only;
    ``overrides``: the engine config's ``sampling_overrides``)."""
    param: dict[str, Any] = {
        "temperature": sampling.temperature,  # 0 = greedy in SGLang
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,  # SGLang: -1 = off
        "min_p": sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty,
        "max_new_tokens": sampling.max_new_tokens,
        "skip_special_tokens": True,
        "stop_token_ids": list(stop_ids),
    }
    if sampling.stop:
        param["stop"] = list(sampling.stop)
    if seed is not None:
        param["sampling_seed"] = seed
    param.update(overrides or {})
    return param


def sglang_engine_kwargs(config: Any, served: ServedPolicy, lora: LoraSpec | None) -> dict[str, Any]:
    """``sglang.Engine``'s arguments for ``config`` (an ``SGLangEngineConfig``). With the memory saver, ``enable_weights_cpu_backup=True``: without
    it SGLang's ``release_memory_occupation`` keeps no copy of the weights, so an engine woken without a
    full push (a LoRA push, or ``every_n_steps > 1``) would serve garbage. A float32 policy gets the
    Triton attention backend (SGLang's Hopper default, FA3, takes 16-bit inputs only); the scheduler
    starts at this process's current CUDA device (``base_gpu_id``). ``engine_kwargs`` win over both."""
    kwargs: dict[str, Any] = dict(
        model_path=served.path,
        tokenizer_path=served.path,
        dtype=config.dtype or served.dtype,
        trust_remote_code=served.trust_remote_code,
        mem_fraction_static=config.mem_fraction_static,
        tp_size=config.tp_size,
        random_seed=config.random_seed,
        log_level="error",
    )
    if config.context_length is not None:
        kwargs["context_length"] = config.context_length
    if config.deterministic:
        kwargs["enable_deterministic_inference"] = True
    if config.enable_memory_saver:
        kwargs.update(enable_memory_saver=True, enable_weights_cpu_backup=True)
    if str(kwargs["dtype"]) in ("float32", "float"):
        kwargs["attention_backend"] = "triton"
    if torch.cuda.is_available():
        kwargs["base_gpu_id"] = torch.cuda.current_device()
    if lora is not None:
        kwargs.update(
            enable_lora=True,
            max_lora_rank=lora.rank,
            lora_target_modules=list(lora.target_modules or ["all"]),
            max_loras_per_batch=2,  # the adapter and base-only requests
        )
    kwargs.update(config.engine_kwargs)
    return kwargs
