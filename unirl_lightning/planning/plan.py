"""``unirl-lightning plan``: a recipe checked against the cluster it names, before anyone rents one.

:func:`plan_recipe` takes a fit config as plain data (what the CLI parsed, defaults filled in), a
declared cluster and the model's shapes (a ``config.json``), and returns the findings: the setup
rules of :mod:`unirl_lightning.core.preflight` (the same functions ``fit`` runs), the placement of every
training rank and rollout worker on the cluster, and an estimate of the memory of each training GPU
and each vLLM worker. Nothing is built: no model, no Ray, no engine (standard library only).

The memory figures are an **estimate** (bytes, per GPU; ``docs/gpus.md`` has the terms):

* training rank: fp32 master weights and AdamW's two moments of the trainable parameters (12 bytes
  each, sharded over the FSDP ranks of a node), the frozen weights in the policy's dtype (LoRA base,
  KL reference), the FSDP2 all-gather of two blocks in fp32, one pushed tensor, and the step's peak
  (:func:`step_peak`): the fp32 gradients, the activations of one micro-batch (every block's; with
  checkpointing each block's input plus one block's), the logits of the chunked log-probs and their
  gradient, the LM head's incoming gradient and autocast's low-precision weight copies, which add up
  with several micro-batches and do not all coexist with one (:func:`step_memory_terms`);
* vLLM worker: weights in the serving dtype over the tensor-parallel GPUs, a fixed activation
  profile, and what is left of ``gpu_memory_utilization`` for the KV cache, against the sequences
  the batch, group and in-flight settings put on it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from unirl_lightning.core.device_rules import (
    checkpoint_names_error,
    recipe_device_errors,
    renamed_by_transformers,
    shared_gpu_memory_error,
)
from unirl_lightning.core.preflight import (
    SHARED_DEVICE_PLACEMENTS,
    chat_template_warning,
    config_value,
    hybrid_engine_error,
    multi_node_ray_error,
    precision_warning,
    resolve_weight_sync_name,
    serving_engine,
    sync_replacement_error,
)
from unirl_lightning.planning.memory import ModelShape, step_estimate, step_memory_terms, step_peak

__all__ = [
    "FSDP_STRATEGY",
    "Cluster",
    "Finding",
    "ModelShape",
    "parse_cluster",
    "plan_recipe",
    "step_estimate",
    "step_memory_terms",
    "step_peak",
    "world_size",
]

GIB = 1024**3
FSDP_STRATEGY = "unirl_lightning.strategy.AsyncRolloutFSDPStrategy"
DDP_STRATEGY = "unirl_lightning.strategy.AsyncRolloutDDPStrategy"
VLLM_ENGINE = "unirl_lightning.engines.vllm.VLLMEngineConfig"
CAUSAL_LM_SPECS = tuple(  # the public paths and where the classes are defined
    f"unirl_lightning.models.{where}{name}"
    for where in ("", "causal_lm.")
    for name in ("PretrainedCausalLM", "TinyCausalLM")
)
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


def world_size(trainer: Any, gpus_per_node: int = 0) -> int:
    """The training ranks ``trainer.devices`` x ``trainer.num_nodes`` name (``trainer``: the config's
    trainer section, a dict or a Namespace): a list of devices, a count, or ``-1`` (every GPU of a node:
    ``gpus_per_node``, at least 1); anything else counts as one rank per node."""
    devices = trainer.get("devices", "auto")
    nodes = int(trainer.get("num_nodes") or 1)
    if isinstance(devices, list):
        per_node = len(devices)
    elif isinstance(devices, int) and devices >= 0 or (isinstance(devices, str) and devices.isdigit()):
        per_node = int(devices)
    elif devices == -1:
        per_node = gpus_per_node or 1
    else:
        per_node = 1
    return per_node * nodes


def _prompt_tokens(config: dict[str, Any]) -> int:
    """The prompt tokens per row: the data module's ``max_prompt_length`` (a bound: longer prompts
    are dropped), else :data:`PROMPT_TOKENS_GUESS`."""
    return int(
        config_value(config, "data", "init_args", "max_prompt_length", default=None) or PROMPT_TOKENS_GUESS
    )


def plan_recipe(config: dict[str, Any], cluster: Cluster, shape: ModelShape | None) -> dict[str, Any]:
    """The findings and figures of ``config`` (a parsed fit config as plain data) on ``cluster``."""
    findings: list[Finding] = []
    trainer = config.get("trainer") or {}
    strategy = trainer.get("strategy") if isinstance(trainer.get("strategy"), dict) else {}
    rollout = strategy.get("init_args") or {}
    model = config_value(config, "model", "init_args", default={})
    policy = config_value(model, "policy", "init_args", default={})
    world = world_size(trainer, cluster.gpus)
    per_node = max(1, world // int(trainer.get("num_nodes") or 1))
    sharded = strategy.get("class_path") == FSDP_STRATEGY
    restarts = int(rollout.get("max_worker_restarts", 3))
    placement = str(rollout.get("placement", "separate"))
    weight_sync = resolve_weight_sync_name(placement, str(rollout.get("weight_sync", "auto")))
    error = sync_replacement_error(str(weight_sync), sharded, world, restarts)
    if error:
        findings.append(Finding("error", "trainer.strategy.init_args.max_worker_restarts", error))
    engine = rollout.get("engine", "auto")
    engine = str(engine.get("class_path", "")) if isinstance(engine, dict) else str(engine)
    error = hybrid_engine_error(placement, engine, world)
    if error:
        findings.append(Finding("error", "trainer.strategy.init_args.engine", error))
    on_cuda = not cluster.cpu and str(trainer.get("accelerator") or "auto") != "cpu"
    findings.extend(Finding("error", key, message) for key, message in recipe_device_errors(config, on_cuda))
    serving = serving_engine(engine)
    if shape is not None and shape.model_type:
        renamed = renamed_by_transformers(shape.model_type)
        names = checkpoint_names_error(shape.model_type, renamed, serving)
        if names:
            findings.append(Finding("error", "trainer.strategy.init_args.engine", names))
    multi_node = multi_node_ray_error(int(trainer.get("num_nodes") or 1), None)
    if multi_node:  # fit refuses it unless RAY_ADDRESS is set at launch
        findings.append(Finding("warning", "trainer.num_nodes", "at launch: " + multi_node))
    causal = (
        config_value(model, "policy", "class_path") in CAUSAL_LM_SPECS
    )  # the modules that autocast themselves
    warning = precision_warning(trainer.get("precision"), policy.get("dtype")) if causal else None
    if warning:
        findings.append(Finding("warning", "trainer.precision", warning))
    if shape is not None and shape.has_chat_template is not None:
        chat = chat_template_warning(
            bool(policy.get("chat")), shape.has_chat_template, str(policy.get("name_or_path"))
        )
        if chat:
            findings.append(Finding("warning", "model.init_args.policy.init_args.chat", chat))
    max_new = int(model.get("max_new_tokens") or 16)
    if shape is not None and shape.positions and max_new >= shape.positions:
        findings.append(
            Finding(
                "error",
                "model.init_args.max_new_tokens",
                f"max_new_tokens={max_new} does not fit the model's {shape.positions} positions",
            )
        )
    figures: dict[str, Any] = {"world_size": world}
    pretrained = str(config_value(model, "policy", "class_path")).endswith("PretrainedCausalLM")
    if not cluster.cpu and causal and pretrained and shape is None:
        findings.append(
            Finding(
                "error",
                "model_config",
                f"no model shape for {policy.get('name_or_path')!r}, so the memory of each GPU cannot be "
                "checked: pass --model_config DIR (a folder with the model's config.json and "
                "tokenizer_config.json, e.g. the model's hub folder)",
            )
        )
    elif not cluster.cpu and (shape is None or not causal):
        findings.append(
            Finding(
                "info",
                "model",
                "memory not estimated: it is for causal-LM recipes whose model shapes are known "
                "(--model_config DIR); the rules and the placement were checked",
            )
        )
    if not cluster.cpu:
        _plan_placement(findings, figures, rollout, world, per_node, cluster)
        if shape is not None and causal:
            _plan_training_memory(findings, figures, config, shape, cluster, per_node if sharded else 1)
            _plan_worker_memory(findings, figures, config, shape, cluster, world)
            _plan_shared_gpu(findings, figures, rollout, cluster)
    ok = not any(f.level == "error" for f in findings)
    return {"ok": ok, "findings": [dataclasses.asdict(f) for f in findings], "figures": figures}


def _plan_placement(
    findings: list[Finding],
    figures: dict[str, Any],
    rollout: dict[str, Any],
    world: int,
    per_node: int,
    cluster: Cluster,
) -> None:
    workers = world * int(rollout.get("num_workers", 1))
    gpus_per_worker = float(rollout.get("num_gpus_per_worker", 0))
    shared = rollout.get("placement", "separate") in SHARED_DEVICE_PLACEMENTS  # engines on training GPUs
    worker_gpus = 0.0 if shared else workers * gpus_per_worker
    scoring = rollout.get("reward_workers") if isinstance(rollout.get("reward_workers"), dict) else {}
    reward_workers = world * int(scoring.get("num_workers", 1)) if scoring else 0
    reward_gpus = reward_workers * float(
        scoring.get("num_gpus_per_worker", 0)
    )  # their own GPUs, even colocated
    figures["placement"] = {
        "training_gpus": world,
        "workers": workers,
        "worker_gpus": worker_gpus,
        "cluster_gpus": cluster.nodes * cluster.gpus,
    }
    if scoring:
        figures["placement"].update(reward_workers=reward_workers, reward_worker_gpus=reward_gpus)
    if per_node > cluster.gpus:
        findings.append(
            Finding(
                "error",
                "trainer.devices",
                f"{per_node} training ranks per node do not fit a node of {cluster.gpus} GPUs",
            )
        )
    total = world + worker_gpus + reward_gpus
    if total > cluster.nodes * cluster.gpus:
        scorers = (
            f" + {reward_workers} reward workers x {reward_gpus / reward_workers:g} GPUs"
            if reward_gpus
            else ""
        )
        findings.append(
            Finding(
                "error",
                "trainer.strategy.init_args.reward_workers"
                if reward_gpus
                else "trainer.strategy.init_args.num_workers",
                f"{world} training GPUs + {workers} workers x {gpus_per_worker:g} GPUs{scorers} = "
                f"{total:g} GPUs, more than the cluster's {cluster.nodes * cluster.gpus}",
            )
        )
    engine = rollout.get("engine")
    tp = config_value(engine, "init_args", "tensor_parallel_size") if isinstance(engine, dict) else None
    if tp is not None and gpus_per_worker and int(tp) != gpus_per_worker:
        findings.append(
            Finding(
                "error",
                "trainer.strategy.init_args.engine.init_args.tensor_parallel_size",
                f"tensor_parallel_size={tp} differs from num_gpus_per_worker={gpus_per_worker:g}",
            )
        )


def _plan_shared_gpu(
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
    if placement != "separate":
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


def _micro_batch_tokens(config: dict[str, Any], rows: int, row_tokens: int) -> int:
    model = config_value(config, "model", "init_args", default={})
    budget = model.get("micro_batch_tokens")
    cap_rows = model.get("micro_batch_rows")
    tokens = rows * row_tokens
    if cap_rows:
        tokens = min(tokens, int(cap_rows) * row_tokens)
    if budget:
        tokens = min(tokens, max(int(budget), row_tokens))
    return tokens


def _plan_training_memory(
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
    row_tokens = _prompt_tokens(config) + max_new
    tokens = _micro_batch_tokens(config, rows, row_tokens)
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


def _plan_worker_memory(
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
    row_tokens = _prompt_tokens(config) + int(model.get("max_new_tokens") or 16)
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
