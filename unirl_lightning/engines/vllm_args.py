"""The arguments vLLM's engine is built with, as pure functions (no vLLM import): the engine's
``LLM(**kwargs)`` (the streaming engine's ``AsyncEngineArgs(**kwargs)`` takes the same), and each
request's ``SamplingParams(**kwargs)``."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from unirl_lightning.models.lora import LoraSpec
from unirl_lightning.rollout.records import SamplingParams

if TYPE_CHECKING:
    from unirl_lightning.engines.serving import ServedPolicy

__all__ = [
    "CPU_MAX_MODEL_LEN",
    "OWNED_SAMPLING_FIELDS",
    "VLLM_LORA_RANKS",
    "vllm_engine_kwargs",
    "vllm_sampling_kwargs",
]

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values
CPU_MAX_MODEL_LEN = 2048
# SamplingParams fields the engine sets itself (the log-prob and stop contracts depend on them)
OWNED_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "logprobs",
    "seed",
    "detokenize",
)


def vllm_sampling_kwargs(
    sampling: SamplingParams,
    stop_ids: list[int],
    seed: int | None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """vLLM ``SamplingParams(**kwargs)`` for one ``n=1`` sample of ``sampling`` (``overrides``: the
    engine config's ``sampling_overrides``). Greedy (temperature 0) turns truncation off."""
    greedy = sampling.temperature == 0
    kwargs: dict[str, Any] = dict(
        n=1,
        temperature=sampling.temperature,
        top_p=1.0 if greedy else sampling.top_p,
        top_k=0 if greedy or sampling.top_k == 0 else sampling.top_k,  # vLLM: 0 (or -1) = off
        min_p=0.0 if greedy else sampling.min_p,
        repetition_penalty=sampling.repetition_penalty,
        max_tokens=sampling.max_new_tokens,
        stop=list(sampling.stop) or None,
        stop_token_ids=list(stop_ids),  # EOS (and a chat template's end of turn), kept
        logprobs=0,  # the sampled token's log-prob only
        seed=seed,
        detokenize=bool(sampling.stop),  # stop strings need text; otherwise we decode
    )
    kwargs.update(overrides or {})
    return kwargs


def model_context(path: str) -> int:
    """The model's own position limit from its saved ``config.json`` (vLLM refuses a longer
    ``max_model_len``); ``CPU_MAX_MODEL_LEN`` when the config does not say."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return int(json.load(f).get("max_position_embeddings") or CPU_MAX_MODEL_LEN)
    except (OSError, ValueError):
        return CPU_MAX_MODEL_LEN


def vllm_engine_kwargs(
    config: Any, served: ServedPolicy, on_cpu: bool, lora: LoraSpec | None, sleep_supported: bool
) -> dict[str, Any]:
    """``vllm.LLM``'s keyword arguments for ``served`` under ``config`` (a ``VLLMEngineConfig``; ``engine_kwargs`` win over the
    fields). ``distributed_executor_backend`` is passed when the config has one (the strategy resolves
    None with :func:`~unirl_lightning.core.device_rules.vllm_executor_backend`: ``"mp"`` for
    ``tensor_parallel_size > 1`` under the actor layout, where vLLM's default, its Ray executor, cannot
    place an engine inside the actor's one multi-GPU bundle)."""
    kwargs: dict[str, Any] = dict(
        model=served.path,
        dtype=served.dtype,
        trust_remote_code=served.trust_remote_code,
        seed=config.seed,
        enforce_eager=config.enforce_eager,
        tensor_parallel_size=config.tensor_parallel_size or 1,  # None: built outside a strategy
        gpu_memory_utilization=config.gpu_memory_utilization,
        logprobs_mode="processed_logprobs",
        worker_extension_cls="unirl_lightning.engines.vllm_worker.VLLMWorkerExtension",
    )
    kv_cache_gib = config.kv_cache_gib if config.kv_cache_gib is not None else (0.25 if on_cpu else None)
    if kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 1024**3)
    if config.max_model_len is not None:
        kwargs["max_model_len"] = config.max_model_len
    elif on_cpu:  # the CPU KV cache is small: a model's full context (8k for SmolLM2) would not fit
        kwargs["max_model_len"] = min(CPU_MAX_MODEL_LEN, model_context(served.path))
    if lora is not None:
        kwargs.update(
            enable_lora=True,
            max_loras=1,
            max_cpu_loras=2,  # the new version is added before the old one is removed
            max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= lora.rank),
        )
    if sleep_supported:  # only when enabled (colocate, hybrid) and supported
        kwargs["enable_sleep_mode"] = True
    if config.distributed_executor_backend is not None:
        kwargs["distributed_executor_backend"] = config.distributed_executor_backend
    transfer = config.engine_kwargs.get("weight_transfer_config")
    backend = transfer.get("backend") if isinstance(transfer, dict) else getattr(transfer, "backend", None)
    if transfer is not None and backend != "unirl":
        raise ValueError(
            f"engine.init_args.engine_kwargs.weight_transfer_config sets backend={backend!r}: the engine pushes "
            "through vLLM's weight-transfer calls on its own backend, 'unirl' (the trainer's weight_sync picks "
            "the transport: object_store or collective); remove weight_transfer_config"
        )
    kwargs["weight_transfer_config"] = {"backend": "unirl"}
    kwargs.update(config.engine_kwargs)
    return kwargs
