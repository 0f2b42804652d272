"""The predictions of the streaming simulator: each setting's colocated sync against async over the
generation shares x ``max_staleness`` (:func:`search`). Standard library only.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

from benchmarks.harness import common  # noqa: F401 - this checkout first on sys.path
from benchmarks.simulation.streaming.calibrate import MODELS, kv_budget, roofline, with_law
from benchmarks.simulation.streaming.trainer import run

SETTINGS = {  # the workloads predicted (engines of tp GPUs); --gpus applies to "ours"
    "areal": {  # AReaL's 2.77x: DeepSeek-R1-Distill-Qwen-1.5B on 16 nodes of 8 H800s
        "model": "1.5b",
        "prompts_per_gpu": 4,
        "median_len": 6000,
        "sigma": 1.0,
        "max_new_tokens": 27648,
        "recompute": True,
    },
    "ours": {"model": "7b", "median_len": 3000, "sigma": 0.9, "max_new_tokens": 16384, "recompute": False},
}
SETTINGS["areal-7b"] = {**SETTINGS["areal"], "model": "7b"}  # the same workload with a 7B model


def base_cfg(
    args: Any, costs: dict[str, float], setting: dict[str, Any], gpus: int, law: str
) -> SimpleNamespace:
    tp, hw, model = args.tp, args.hardware, setting["model"]
    model_gb = args.model_gb if args.model_gb >= 0 else 2 * MODELS[model]["params"] / 1e9
    cfg = SimpleNamespace(
        prompt_len=args.prompt_len,
        samples=args.samples,
        median_len=setting["median_len"],
        sigma=setting["sigma"],
        max_new_tokens=setting["max_new_tokens"],
        seed=args.seed,
        **roofline(tp, costs["scale"], hw, model),
        tp=tp,
        max_rows=args.rows_per_gpu * tp,
        kv_tokens=kv_budget(tp, hw, model=model),
        per_call=args.per_call,
        resume_prefill=args.resume_prefill,
        sync_recompute=setting["recompute"],
        async_recompute=setting["recompute"],
        push_s=model_gb * (args.push_s_per_gb if args.push_s_per_gb >= 0 else costs["push_s"] / 15.2),
        quiesce=args.quiesce,
        groups_per_step=max(1, round(setting.get("prompts_per_gpu", args.prompts_per_gpu) * gpus)),
        sync_interval=1,
        steps=args.steps,
        warmup=args.warmup,
    )
    return with_law(cfg, costs, law, hw, model)


def brief(r: dict[str, Any], sync: dict[str, Any], k: int = 1) -> dict[str, Any]:
    """An async run against sync; its steps are ``k`` simulated steps (``--steps-per-sync``)."""
    lost = r["groups"]["evicted"] + r["groups"]["dropped"]
    return {
        "over_sync": r["groups_per_s"] / sync["groups_per_s"],
        "tokens_over_sync": r["trained_tokens_per_s"] / sync["trained_tokens_per_s"],
        "occupancy": r["occupancy"],
        "lost_group_share": lost / max(1, r["groups"]["submitted"]),
        "wasted_token_share": r["wasted_token_share"],
        "token_staleness": r["token_staleness"],
        "s_per_step": k * r["s_per_batch"],
        "phases_s_per_step": {phase: k * s for phase, s in r["phases_s_per_batch"].items()},
    }


def search(args: Any, costs: dict[str, float], name: str, gpus: int, law: str) -> dict[str, Any]:
    """Sync on all ``gpus``, then async over the generation shares x staleness; the best by groups/s."""
    setting = SETTINGS[name]
    cfg = base_cfg(args, costs, setting, gpus, law)
    tp = args.tp
    sync = run(
        SimpleNamespace(
            **{
                **vars(cfg),
                "mode": "sync",
                "gen_gpus": gpus,
                "train_gpus": gpus,
                "max_staleness": 0,
                "evict_staleness": 0,
                "max_inflight": 1 << 30,
                "steps": 3,
                "warmup": 1,
            }
        )
    )
    k = args.steps_per_sync  # verl's require_batches: the first part trains while the rest finish
    part = dict(groups_per_step=max(1, cfg.groups_per_step // k), sync_interval=k, steps=cfg.steps * k)
    part["warmup"] = cfg.warmup * k
    splits = sorted({min(gpus - 1, max(tp, tp * round(s * gpus / tp))) for s in args.gen_shares})
    runs = []
    for gen in splits:
        engines = gen // tp
        for s in args.staleness:
            over = {
                "mode": "async",
                "gen_gpus": gen,
                "train_gpus": gpus - gen,
                "max_staleness": s,
                "evict_staleness": s,
                "max_inflight": math.ceil(engines * cfg.max_rows / cfg.samples),
            }
            r = run(SimpleNamespace(**{**vars(cfg), **over, **part}))
            runs.append({"gen_gpus": gen, "train_gpus": gpus - gen, "max_staleness": s, **brief(r, sync, k)})
    best = max(runs, key=lambda r: r["over_sync"])
    over = {
        "mode": "async",
        "gen_gpus": best["gen_gpus"],
        "train_gpus": best["train_gpus"],
        "quiesce": True,
        "max_staleness": best["max_staleness"],
        "evict_staleness": best["max_staleness"],
        "max_inflight": math.ceil(best["gen_gpus"] // tp * cfg.max_rows / cfg.samples),
    }
    drained = brief(run(SimpleNamespace(**{**vars(cfg), **over, **part})), sync, k)
    keys = ("hardware", "tp", "rows_per_gpu", "resume_prefill", "prompt_len", "samples", "prompts_per_gpu")
    keys += ("gen_shares", "staleness", "model_gb", "push_s_per_gb", "steps", "warmup", "seed")
    keys += ("steps_per_sync",)
    return {
        "args": {k: getattr(args, k) for k in keys},
        "hardware": args.hardware,
        "model": MODELS[setting["model"]]["name"],
        "tp": tp,
        "gpus": gpus,
        "groups_per_step": cfg.groups_per_step,
        "train_law": law,
        "sync": {
            "s_per_step": sync["s_per_batch"],
            "phases_s_per_step": sync["phases_s_per_batch"],
            "occupancy": sync["occupancy"],
        },
        "best": best,
        "best_with_quiesce": {k: drained[k] for k in ("over_sync", "occupancy", "phases_s_per_step")},
        "runs": runs,
    }
