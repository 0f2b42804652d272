"""``unirl-lightning plan``: a recipe checked against the cluster it names, before anyone rents one.

:func:`plan_recipe` takes a fit config as plain data (what the CLI parsed, defaults filled in), a
declared cluster and the model's shapes (a ``config.json``), and returns the findings: the setup
rules of :mod:`unirl_lightning.core.preflight` (the same functions ``fit`` runs), the placement of every
training rank and rollout worker on the cluster, and an estimate of the memory of each training GPU
and each vLLM worker. Nothing is built: no model, no Ray, no engine (standard library only).

The memory figures are an **estimate** (bytes, per GPU), made by :mod:`unirl_lightning.planning.budgets`
(``docs/gpus.md`` has the terms).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from unirl_lightning.core.device_rules import (
    checkpoint_names_error,
    recipe_device_errors,
    renamed_by_transformers,
)
from unirl_lightning.core.preflight import (
    SHARED_DEVICE_PLACEMENTS,
    chat_template_warning,
    config_value,
    hybrid_engine_error,
    inflight_window_warning,
    multi_node_ray_error,
    precision_warning,
    recipe_sync_every,
    resolve_weight_sync_name,
    serving_engine,
    sync_replacement_error,
)
from unirl_lightning.planning.budgets import (
    Cluster,
    Finding,
    parse_cluster,
    plan_shared_gpu,
    plan_training_memory,
    plan_worker_memory,
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

FSDP_STRATEGY = "unirl_lightning.strategy.AsyncRolloutFSDPStrategy"
DDP_STRATEGY = "unirl_lightning.strategy.AsyncRolloutDDPStrategy"
CAUSAL_LM_SPECS = tuple(  # the public paths and where the classes are defined
    f"unirl_lightning.models.{where}{name}"
    for where in ("", "causal_lm.")
    for name in ("PretrainedCausalLM", "TinyCausalLM")
)


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
    inflight = inflight_window_warning(
        str(rollout.get("launch_unit", "request")),
        int(rollout.get("max_staleness", 1)),
        int(rollout.get("max_inflight", 2)),
        recipe_sync_every(config),
    )
    if inflight:
        findings.append(Finding("warning", "trainer.strategy.init_args.max_inflight", inflight))
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
            plan_training_memory(findings, figures, config, shape, cluster, per_node if sharded else 1)
            plan_worker_memory(findings, figures, config, shape, cluster, world)
            plan_shared_gpu(findings, figures, rollout, cluster)
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
