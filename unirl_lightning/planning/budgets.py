"""The memory budgets of ``unirl-lightning plan``: the cluster a recipe is planned for
(:class:`Cluster`, :func:`parse_cluster`), a plan's :class:`Finding`, and the estimate of each
training GPU, each vLLM worker and a GPU they share (:func:`plan_training_memory`,
:func:`plan_worker_memory`, :func:`plan_shared_gpu`), in bytes per GPU. Standard library only.

* training rank: fp32 master weights and AdamW's two moments of the trainable parameters (12 bytes
  each, sharded over the FSDP ranks of a node), the frozen weights in the policy's dtype (LoRA base,
  KL reference), the FSDP2 all-gather of two blocks in fp32, one pushed tensor, and the step's peak
  (:func:`~unirl_lightning.planning.memory.step_estimate`);
* vLLM worker: weights in the serving dtype over the tensor-parallel GPUs, a fixed activation
  profile, and what is left of ``gpu_memory_utilization`` for the KV cache, against the sequences
  the batch, group and in-flight settings put on it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from unirl_lightning.core.device_rules import shared_gpu_memory_error
from unirl_lightning.core.preflight import config_value
from unirl_lightning.planning.memory import ModelShape, step_estimate

__all__ = [
    "GIB",
    "Cluster",
    "Finding",
    "parse_cluster",
    "plan_shared_gpu",
    "plan_training_memory",
    "plan_worker_memory",
    "prompt_tokens",
]

GIB = 1024**3
VLLM_ENGINE = "unirl_lightning.engines.vllm.VLLMEngineConfig"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ACTIVATION_PROFILE_GIB = 2.0  # vLLM's profiling run: one max-batch forward, a few GiB on a 7B model
PROMPT_TOKENS_GUESS = 256  # the prompt length assumed when the recipe sets no data max_prompt_length


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``gpus`` GPUs with ``gib`` GiB each; ``gpus == 0``: a CPU machine."""

    nodes: int
    gpus: int
    gib: float

    @property
    def cpu(self) -> bool:
        return self.gpus == 0


def parse_cluster(text: str) -> Cluster:
    """``"NODESxGPUSxGIB"`` (``"1x8x80"``: one node of eight 80 GiB GPUs) or ``"cpu"``."""
    if text.strip().lower() == "cpu":
        return Cluster(1, 0, 0.0)
    match = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+(?:\.\d+)?)\s*", text)
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise ValueError(
            f"cluster: expected NODESxGPUSxGIB (e.g. '1x8x80': 1 node of 8 GPUs with 80 GiB each) or 'cpu', got {text!r}"
        )
    return Cluster(int(match[1]), int(match[2]), float(match[3]))


@dataclasses.dataclass(frozen=True)
class Finding:
    """One result of the plan: ``level`` is ``"error"``, ``"warning"`` or ``"info"``; ``key`` the setting."""

    level: str
    key: str
    message: str


def prompt_tokens(config: dict[str, Any]) -> int:
    """The prompt tokens per row: the data module's ``max_prompt_length`` (a bound: longer prompts
    are dropped), else :data:`PROMPT_TOKENS_GUESS`."""
    return int(
        config_value(config, "data", "init_args", "max_prompt_length", default=None) or PROMPT_TOKENS_GUESS
    )


def plan_shared_gpu(
    findings: list[Finding], figures: dict[str, Any], rollout: dict[str, Any], cluster: Cluster
) -> None:
    """:func:`~unirl_lightning.core.device_rules.shared_gpu_memory_error` on the estimates (vLLM engines only)."""
    train, engine = figures.get("training_gpu"), figures.get("vllm_worker_gpu")
    if not train or not engine:
        return
    placement = str(rollout.get("placement", "separate"))
    if placement == "separate":  # engines packed on a share of a GPU: recipe_device_errors
        return
    states = train["states_fp32"]  # float32 masters + AdamW's two moments: a third, two thirds
    shared = {"engine_gib": engine["budget_gib"], "masters_gib": round(states / 3, 2)}
    shared.update(
        frozen_gib=train["frozen_weights"], moments_gib=round(2 * states / 3, 2), gpu_gib=cluster.gib
    )
    offload = bool(rollout.get("offload_optimizer", False))
    held = shared["masters_gib"] + shared["frozen_gib"] + (0 if offload else shared["moments_gib"])
    figures["shared_gpu"] = {
        **shared,
        "offload_optimizer": offload,
        "total_gib": round(held + engine["budget_gib"], 2),
    }
    utilization = engine["budget_gib"] / cluster.gib
    gpus = float(rollout.get("num_gpus_per_worker", 0) or 0)
    error = shared_gpu_memory_error(
        placement,
        offload_optimizer=offload,
        num_gpus_per_worker=gpus,
        utilization=round(utilization, 4),
        **shared,
    )
    if error:
        findings.append(
            Finding("error", "trainer.strategy.init_args.engine.init_args.gpu_memory_utilization", error)
        )


def micro_batch_tokens(config: dict[str, Any], rows: int, row_tokens: int) -> int:
    model = config_value(config, "model", "init_args", default={})
    budget = model.get("micro_batch_tokens")
    cap_rows = model.get("micro_batch_rows")
    tokens = rows * row_tokens
    if cap_rows:
        tokens = min(tokens, int(cap_rows) * row_tokens)
    if budget:
        tokens = min(tokens, max(int(budget), row_tokens))
    return tokens


def plan_training_memory(
    findings: list[Finding],
    figures: dict[str, Any],
    config: dict[str, Any],
    shape: ModelShape,
    cluster: Cluster,
    shards: int,
) -> None:
    model = config_value(config, "model", "init_args", default={})
    policy = config_value(model, "policy", "init_args", default={})
    dtype_bytes = DTYPE_BYTES.get(str(policy.get("dtype", "bfloat16")), 2)
    lora = model.get("lora")
    trainable = shape.lora_params(int(config_value(lora, "rank", default=8))) if lora else shape.params
    frozen = shape.params if lora else 0
    if float(model.get("kl_coef") or 0) > 0 and not lora:
        frozen += shape.params  # the reference copy
    batch = int(config_value(config, "data", "init_args", "batch_size", default=8))
    rows = batch * int(model.get("num_generations") or 8) // max(1, int(model.get("mini_batches") or 1))
    max_new = int(model.get("max_new_tokens") or 16)
    row_tokens = prompt_tokens(config) + max_new
    tokens = micro_batch_tokens(config, rows, row_tokens)
    checkpointing = bool(model.get("gradient_checkpointing"))
    kept = tokens * (max_new + 1) // row_tokens  # the chunked log-probs: completion positions only
    low_precision = dtype_bytes == 2  # bf16/fp16 compute over float32 masters
    step, peak = step_estimate(
        shape,
        tokens,
        kept,
        dtype_bytes,
        checkpointing,
        gradients=4 * trainable / shards,
        micro_batches=math.ceil(rows * row_tokens / tokens),
        trainable_head=not lora,
        autocast_params=trainable if low_precision and shards == 1 else 0,
    )
    terms = {
        "states_fp32": 12 * trainable / shards,  # float32 masters and AdamW's two moments
        "frozen_weights": dtype_bytes * frozen / shards,
        "fsdp_gather": 2 * 4 * shape.block_params if shards > 1 else 0,
        "push_tensor": 2 * shape.vocab * shape.hidden,
        **step,
    }
    static = ("states_fp32", "frozen_weights", "fsdp_gather", "push_tensor")
    total = sum(terms[k] for k in static) + peak
    figures["training_gpu"] = {
        "micro_batch_tokens": tokens,
        "micro_batches": math.ceil(rows * row_tokens / tokens),
        "gradient_checkpointing": checkpointing,
        **{k: round(v / GIB, 2) for k, v in terms.items()},
        "step_peak": round(peak / GIB, 2),
        "total_gib": round(total / GIB, 2),
        "gpu_gib": cluster.gib,
    }

    def listed(keys: Any) -> str:
        return ", ".join(f"{k} {terms[k] / GIB:.1f}" for k in keys)

    if total > cluster.gib * GIB:
        findings.append(
            Finding(
                "error",
                "model.init_args.gradient_checkpointing"
                if not checkpointing
                else "model.init_args.micro_batch_tokens",
                f"a training GPU needs about {total / GIB:.0f} GiB ({listed(static)}, step_peak {peak / GIB:.1f} of "
                f"{listed([k for k in terms if k not in static])}) "
                f"of its {cluster.gib:g} GiB at {tokens} tokens per micro-batch: turn gradient_checkpointing on "
                "and/or lower micro_batch_tokens",
            )
        )


def plan_worker_memory(
    findings: list[Finding],
    figures: dict[str, Any],
    config: dict[str, Any],
    shape: ModelShape,
    cluster: Cluster,
    world: int,
) -> None:
    rollout = config_value(config, "trainer", "strategy", "init_args", default={})
    engine = rollout.get("engine")
    if not (isinstance(engine, dict) and engine.get("class_path") == VLLM_ENGINE):
        return
    args = engine.get("init_args") or {}
    tp = int(
        args.get("tensor_parallel_size") or max(1, math.ceil(float(rollout.get("num_gpus_per_worker", 1))))
    )
    utilization = float(args.get("gpu_memory_utilization", 0.5))
    weights = 2 * shape.params / tp
    budget = utilization * cluster.gib * GIB
    kv_budget = budget - weights - ACTIVATION_PROFILE_GIB * GIB
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2 / tp
    model = config_value(config, "model", "init_args", default={})
    batch = int(config_value(config, "data", "init_args", "batch_size", default=8))
    sequences = (
        batch
        * int(model.get("num_generations") or 8)
        * int(rollout.get("max_inflight", 2))
        // max(1, int(rollout.get("num_workers", 1)))
    )
    row_tokens = prompt_tokens(config) + int(model.get("max_new_tokens") or 16)
    figures["vllm_worker_gpu"] = {
        "weights_gib": round(weights / GIB, 2),
        "budget_gib": round(budget / GIB, 2),
        "kv_cache_gib": round(max(kv_budget, 0) / GIB, 2),
        "kv_tokens": int(max(kv_budget, 0) / kv_per_token),
        "concurrent_sequences": sequences,
        "tokens_needed": sequences * row_tokens,
    }
    key = "trainer.strategy.init_args.engine.init_args.gpu_memory_utilization"
    if kv_budget <= 0:
        findings.append(
            Finding(
                "error",
                key,
                f"a vLLM worker's weights ({weights / GIB:.1f} GiB) and activation profile "
                f"({ACTIVATION_PROFILE_GIB:g} GiB) exceed gpu_memory_utilization={utilization} x {cluster.gib:g} GiB",
            )
        )
    elif kv_budget / kv_per_token < sequences * row_tokens:
        findings.append(
            Finding(
                "warning",
                key,
                f"a vLLM worker's KV cache holds about {int(kv_budget / kv_per_token)} tokens, fewer than the "
                f"{sequences} sequences x {row_tokens} tokens in flight: vLLM queues the rest",
            )
        )
