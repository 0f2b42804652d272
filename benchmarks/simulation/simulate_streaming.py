"""A simulation of STREAMING async RL: groups stream into continuously batching engines and weights are
updated without draining; validated against verl's published phase table, then used to predict.
Standard library only; every number is a flag or printed with its source.

    python -m benchmarks.simulation.simulate_streaming                 # verl check, AReaL's setting, ours
    python -m benchmarks.simulation.simulate_streaming --parts verl    # the verl reproduction alone
    python -m benchmarks.simulation.simulate_streaming --parts here    # against the real engines here

Model (``benchmarks/simulation/streaming/``):

* Units are groups (a prompt x ``samples`` rows). The REAL ``BatchRolloutController`` holds one job per
  group; admission is the REAL ``admit_groups`` (launch ceiling in groups, and ``max_inflight``); a
  training batch is ``drain_freshest(groups_per_step, max_staleness)``, which evicts by launch stamp.
* Engines of ``tp`` GPUs, continuous batching: a group goes whole to the least-loaded engine, its rows
  fill free slots (``max_rows``, and a KV budget) and a finished row's slot is refilled at once. A decode
  step costs ``a + b*rows + c*context_tokens``; a prompt costs ``prefill`` per token once per group.
  Occupancy = time-averaged active rows / slots.
* Sync without draining: ``quiesce(interrupt=True)``, the engines pause for the push and keep their rows
  (re-encoding ``--resume-prefill`` of their context), ``resume(max_staleness)`` drops a group whose
  oldest token would be over the bound. ``--quiesce`` drains in-flight groups before the push instead.
* Trainer: ``train_gpus`` GPUs, ``tokens * s_per_token / speedup(gpus)`` per update (and the same
  for the log-prob recompute where the setting recomputes), then a push of ``model_gb *
  push_s_per_gb``; ``speedup`` is Amdahl's law, a power law or linear (``--train-law``). Sync baseline: colocated, all GPUs generate a step, recompute, train, push.
* Costs: the H20 roofline of a 7B engine (``streaming/calibrate.py``) times one factor, and trainer
  costs, all calibrated on verl's SYNC column; verl's async 64:64 is then predicted.
* ``here`` (``streaming/here.py``): the same simulator with this machine's measured engine step costs
  and trainer costs, against the real long-tail runs (steps/s and occupancy, their errors).
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import Any

from benchmarks.harness import common, envelope
from benchmarks.simulation.streaming.calibrate import (
    LAWS,
    MODELS,
    calibrate,
    kv_budget,
    reproduce,
    roofline,
    with_law,
)
from benchmarks.simulation.streaming.here import calibrate_here, print_here
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


def parser() -> Any:
    p = common.script_parser(__doc__)
    p.add_argument(
        "--parts",
        nargs="+",
        default=["verl", "here", "areal", "areal-7b", "ours"],
        choices=["verl", "here", "areal", "areal-7b", "ours"],
    )
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 32, 128], help="GPU counts for 'ours'")
    p.add_argument("--prompts-per-gpu", type=float, default=4, help="ours: the batch scales with the GPUs")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--gen-shares", type=float, nargs="+", default=[0.25, 0.375, 0.5, 0.625, 0.75, 0.875])
    p.add_argument("--staleness", type=int, nargs="+", default=[1, 2, 4], help="max_staleness searched")
    p.add_argument(
        "--hardware", default="h100", choices=["h20", "h100"], help="of the predictions (H800 = h100)"
    )
    p.add_argument("--tp", type=int, default=1, help="GPUs per engine in the predictions")
    p.add_argument(
        "--rows-per-gpu", type=int, default=256, help="engine slots per GPU (max_rows = this x tp)"
    )
    p.add_argument(
        "--resume-prefill", type=float, default=1.0, help="share of a row's context re-encoded after a push"
    )
    p.add_argument(
        "--train-law", nargs="+", default=["amdahl", "perfect"], choices=LAWS, help="training scaling"
    )
    p.add_argument("--verl-law", default="amdahl", choices=LAWS, help="training scaling of the verl check")
    p.add_argument("--model-gb", type=float, default=-1.0, help="pushed; -1: the setting's model in bf16")
    p.add_argument("--push-s-per-gb", type=float, default=-1.0, help="-1: calibrated (verl's sync rest)")
    p.add_argument(
        "--quiesce", action="store_true", help="every async run drains in-flight groups before a sync"
    )
    p.add_argument(
        "--per-call", action="store_true", help="engines refill only an empty batch (per-call model)"
    )
    p.add_argument("--steps-per-sync", type=int, default=1, help="async: a step's prompts as k steps")
    p.add_argument("--steps", type=int, default=8, help="measured training steps per prediction run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--verl-median-len", type=float, default=1200, help="assumed (unpublished)")
    p.add_argument("--verl-sigma", type=float, default=1.0, help="assumed (unpublished)")
    p.add_argument("--verl-prompt-len", type=int, default=200, help="assumed (unpublished)")
    p.add_argument("--verl-steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", default="simulate_streaming", help="results file (a bare name: in the results folder)"
    )
    return p


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


def previous(out: str) -> dict[str, Any]:
    """The figures already in ``out`` (without their envelope), or nothing."""
    path = envelope.results_path(out)
    if not path.exists():
        return {}
    record = json.loads(path.read_text())
    record.pop("envelope", None)
    return record


def main() -> None:
    config = common.parse_config(parser())
    args = SimpleNamespace(**config)
    record = previous(args.out)  # a part run alone keeps the other parts' figures
    record["assumptions"] = {k: v for k, v in config.items() if k != "out"}
    costs, _ = calibrate(args)
    record["calibrated"] = costs
    if "verl" in args.parts:
        record["verl"] = rep = reproduce(args)
        rep["args"] = {k: v for k, v in config.items() if k.startswith("verl_") or k == "seed"}
        print(f"{'mode':<12} {'phase':<13} {'published':>9} {'simulated':>9} {'error':>7}")
        for row in rep["table"]:
            err = "-" if row["error"] is None else f"{row['error']:+.0%}"
            print(
                f"{row['mode']:<12} {row['phase']:<13} {row['published']:>9.1f} {row['simulated']:>9.1f} {err:>7}"
            )
        for name, s in rep["sensitivity"].items():
            mfu = f", implied update MFU {s['implied_update_mfu']:.0%}" if "implied_update_mfu" in s else ""
            print(f"  async step, {name}: {s['step']:.1f} s ({s['error']:+.0%}){mfu}")
    if "here" in args.parts:
        record["here"] = print_here(calibrate_here(args.seed))
    done = {(p["setting"], p["gpus"], p["train_law"]): p for p in record.get("predictions", [])}
    for name in ("areal", "areal-7b", "ours"):
        if name not in args.parts:
            continue
        for gpus in [128] if name.startswith("areal") else args.gpus:
            for law in args.train_law:
                done[name, gpus, law] = {
                    "setting": name,
                    **search(args, costs, name, gpus, law),
                }
    record["predictions"] = predictions = [done[k] for k in sorted(done)]
    head = "setting GPUs law x_sync tokens_x gen:train stale occ sync_occ lost x_quiesce".split()
    print(" ".join(f"{h:>9}" for h in head))
    for p in predictions:
        b = p["best"]
        cells = (
            p["setting"],
            p["gpus"],
            p["train_law"],
            f"{b['over_sync']:.2f}",
            f"{b['tokens_over_sync']:.2f}",
        )
        cells += (f"{b['gen_gpus']}:{b['train_gpus']}", b["max_staleness"], f"{b['occupancy']:.2f}")
        cells += (f"{p['sync']['occupancy']:.2f}", f"{b['lost_group_share']:.2f}")
        cells += (f"{p['best_with_quiesce']['over_sync']:.2f}",)
        print(" ".join(f"{c:>9}" for c in cells))
    out = common.write_results(record, args.out, indent=1, config=config)
    print(json.dumps({"out": str(out)}))


if __name__ == "__main__":
    main()
