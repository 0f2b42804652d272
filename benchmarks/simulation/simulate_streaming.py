"""A simulation of STREAMING async RL: groups stream into continuously batching engines and weights are
updated without draining; validated against verl's published phase table, then used to predict.
Standard library only; every number is a flag or printed with its source.

    python -m benchmarks.simulation.simulate_streaming                 # verl check, AReaL's setting, ours
    python -m benchmarks.simulation.simulate_streaming --parts verl    # the verl reproduction alone
    python -m benchmarks.simulation.simulate_streaming --parts here    # against the real engines here
    python -m benchmarks.simulation.simulate_streaming --parts areal-eta   # AReaL's own eta 4 / eta 0

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
  push_s_per_gb``; ``speedup`` is Amdahl's law, a power law or linear (``--train-law``). Sync
  baseline: colocated, all GPUs generate a step, recompute, train, push (``areal-eta``: AReaL's own,
  its decoupled split at eta 0; ``streaming/areal.py``).
* Costs: the H20 roofline of a 7B engine (``streaming/calibrate.py``) times one factor, and trainer
  costs, all calibrated on verl's SYNC column; verl's async 64:64 is then predicted, its rollouter's
  launch rules as its source has them (the ceiling at 1.5 versions, 16 prompts per server), and so is
  verl's staleness ablation at thresholds 0-0.5, with the unpublished lengths varied
  (``streaming/verl_ablation.py``).
* ``here`` (``streaming/here.py``): the same simulator with this machine's measured engine step costs
  and trainer costs, against the real long-tail runs (steps/s and occupancy, their errors).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from benchmarks.harness import common, envelope
from benchmarks.simulation.streaming.areal import areal_eta, print_areal_eta
from benchmarks.simulation.streaming.calibrate import LAWS, calibrate, reproduce
from benchmarks.simulation.streaming.here import calibrate_here, print_here
from benchmarks.simulation.streaming.predict import search
from benchmarks.simulation.streaming.verl_ablation import checks as verl_checks
from benchmarks.simulation.streaming.verl_ablation import report as verl_report


def parser() -> Any:
    p = common.script_parser(__doc__)
    p.add_argument(
        "--parts",
        nargs="+",
        default=["verl", "here", "areal", "areal-eta", "areal-7b", "ours"],
        choices=["verl", "here", "areal", "areal-eta", "areal-7b", "ours"],
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
    p.add_argument(
        "--areal-max-new-tokens",
        type=int,
        default=27648,
        help="areal-eta: 27648 (its configs) or 8192 (its note)",
    )
    p.add_argument("--steps", type=int, default=8, help="measured training steps per prediction run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--verl-median-len", type=float, default=1200, help="assumed (unpublished)")
    p.add_argument("--verl-sigma", type=float, default=1.0, help="assumed (unpublished)")
    p.add_argument("--verl-prompt-len", type=int, default=200, help="assumed (unpublished)")
    p.add_argument(
        "--verl-sync-gen-overhead",
        type=float,
        default=0.0,
        help="seconds of verl's colocated gen timer not decoding (wake-up, weight load, sleep): unpublished",
    )
    p.add_argument(
        "--verl-fit",
        default="all",
        choices=("all", "fixed"),
        help="the verl calibration's factor: on every engine cost, or on the fixed cost per decode step alone",
    )
    p.add_argument("--verl-steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", default="simulate_streaming", help="results file (a bare name: in the results folder)"
    )
    return p


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
    costs, cfg = calibrate(args)
    record["calibrated"] = costs
    if "verl" in args.parts:
        record["verl"] = rep = {**reproduce(args), **verl_checks(args, cfg)}
        rep["args"] = {k: v for k, v in config.items() if k.startswith("verl_") or k == "seed"}
        print(f"{'mode':<12} {'phase':<13} {'published':>9} {'simulated':>9} {'error':>7}")
        for row in rep["table"]:
            err = "-" if row["error"] is None else f"{row['error']:+.0%}"
            print(
                f"{row['mode']:<12} {row['phase']:<13} {row['published']:>9.1f} {row['simulated']:>9.1f} {err:>7}"
            )
        for name, s in rep["sensitivity"].items():
            mfu = f", implied update MFU {s['implied_update_mfu']:.0%}" if "implied_update_mfu" in s else ""
            print(f"  async step, {name}: {s['step']:.1f} s ({s['error']:+.0%}), wait {s['wait']:.1f} s{mfu}")
        verl_report(rep)
    if "here" in args.parts:
        record["here"] = print_here(calibrate_here(args.seed))
    if "areal-eta" in args.parts:
        record["areal_eta"] = [
            areal_eta(args, costs, law, with_grid=law == "amdahl") for law in args.train_law
        ]
        for result in record["areal_eta"]:
            print_areal_eta(result)
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
