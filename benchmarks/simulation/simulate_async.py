"""Predict what async and interruptible generation buy at 8-128 GPUs: the REAL controller and loop
(``BatchRolloutController``, ``ChunkedGeneration``, ``RolloutLoop``) driven on a discrete clock by
simulated engines and a simulated trainer. Standard library only.

    python -m benchmarks.simulation.simulate_async     # the 8 / 32 / 128-GPU table
    python -m benchmarks.simulation.simulate_async --calibrate benchmarks/results/interrupt_long_tail.json

Model (every number is a flag):

* Engines: ``E`` instances of one GPU each, each serving the parts of requests one at a time in
  launch order (as our workers do). A decode step with ``b`` rows in the batch takes
  ``step_s * (1 + b / half_batch)`` (the batch-size curve: throughput ``b / step`` saturates at
  ``half_batch / step_s`` tokens/s per GPU); rows leave the batch as they finish. Each call (and each
  resumed chunk) pays a prefill of ``prefill_s_per_token`` per prompt + partial token.
* Lengths: ``long_tail`` draws a lognormal (median ``median_len``, sigma ``sigma``) clipped at
  ``max_new_tokens``, the shape of published reasoning-length histograms (a mode well below the
  budget and a mass at the cap); or ``--lengths FILE`` (a JSON list, e.g. measured lengths).
* Trainer: ``T`` GPUs, ``train_s_per_token`` seconds per trained token per GPU; a push takes
  ``model_gb * push_s_per_gb`` (all the trainer's time: async training does not overlap the push).
* Modes, as the runtime runs them: ``sync`` (colocated: all ``E + T`` GPUs generate, then all train;
  ``max_staleness=0, max_inflight=1``), ``async_quiesce`` and ``async_interrupt`` (``E`` engine GPUs,
  ``T`` trainer GPUs, ``max_staleness=1, max_inflight=2``); every step: train, then
  ``quiesce(interrupt=...)``, push, ``sync_weights``, ``resume`` (the runtime's order).

Reports trained tokens/s, engine idle fraction, mean quiesce seconds, and the staleness histogram of
the trained tokens (the loop's ``rollout/token_staleness/k``).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks.harness import common
from benchmarks.simulation.sim import Sim


def simulate(args: SimpleNamespace, gpus: int, lengths: list[int] | None) -> dict[str, Any]:
    trainer = max(1, round(gpus * args.trainer_share))
    engines = gpus - trainer
    out = {}
    for mode in ("sync", "async_quiesce", "async_interrupt"):
        e, t = (gpus, gpus) if mode == "sync" else (engines, trainer)
        out[mode] = Sim(args, mode, e, t, lengths).run(args.steps)
    sync = out["sync"]["tokens_per_s"]
    for mode in out:
        out[mode]["over_sync"] = out[mode]["tokens_per_s"] / sync
    return {"gpus": gpus, "trainer_gpus": trainer, "engine_gpus": engines, **out}


def parser() -> Any:
    p = common.script_parser(__doc__)
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument(
        "--trainer-share", type=float, default=0.25, help="fraction of the GPUs that train (async)"
    )
    p.add_argument("--prompts", type=int, default=64, help="prompts per step")
    p.add_argument("--samples", type=int, default=16, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=16384)
    p.add_argument("--median-len", type=float, default=3000)
    p.add_argument("--sigma", type=float, default=0.9)
    p.add_argument("--lengths", help="a JSON file: a list of completion lengths to draw from")
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--step-s", type=float, default=0.02, help="decode step of an empty-ish batch, per GPU")
    p.add_argument("--half-batch", type=float, default=128, help="rows at which a step takes twice as long")
    p.add_argument("--prefill-s-per-token", type=float, default=2e-6)
    p.add_argument(
        "--train-s-per-token", type=float, default=2.5e-4, help="per trained token per trainer GPU"
    )
    p.add_argument("--model-gb", type=float, default=16)
    p.add_argument("--push-s-per-gb", type=float, default=0.5)
    p.add_argument("--chunk", type=int, default=512, help="interrupt_chunk_tokens")
    p.add_argument("--block", type=int, default=64, help="decode steps simulated at once (resolution)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibrate", help="a results JSON of interrupt_long_tail (benchmarks/results/)")
    p.add_argument(
        "--out", default="simulate_async", help="results file (a bare name: in the results folder)"
    )
    return p


def calibrate(args: SimpleNamespace) -> dict[str, Any]:
    """Simulate the measured tiny workload (one worker, one trainer, the phase costs measured there)
    and compare the predicted async/sync ratios with the measured ones."""
    record = json.loads(Path(args.calibrate).read_text())
    config, med = record["summary"]["config"], record["summary"]["medians"]
    sync_runs = [r for r in record["runs"] if r["mode"] == "sync"]
    lengths = [n for r in sync_runs for n in r["completion_lengths"]]
    rows = config["batch"] * config["group"]
    tokens_per_step = sum(lengths) / len(lengths) * rows
    sim = SimpleNamespace(**vars(args))
    sim.prompts, sim.samples, sim.max_new_tokens = config["batch"], config["group"], config["max_new_tokens"]
    sim.chunk, sim.block, sim.prompt_len, sim.steps, sim.warmup = (
        config["chunk"],
        1,
        12,
        config["steps"],
        config["warmup"],
    )
    # phase costs: the sync run's generation per request is a batch of `rows` rows as long as its longest
    sim.half_batch = 1e9  # CPU: a decode step costs the same for any batch that fits (measured below)
    sim.step_s = med["sync"]["generate_s"] / config["max_new_tokens"]
    sim.prefill_s_per_token = 0.0
    sim.train_s_per_token = med["sync"]["train_s"] / tokens_per_step
    sim.model_gb, sim.push_s_per_gb = 1.0, med["sync"]["push_s"]
    out = {}
    for mode in ("sync", "async_quiesce", "async_interrupt"):
        out[mode] = Sim(sim, mode, 1, 1, lengths).run(sim.steps)
    predicted = {m: out[m]["tokens_per_s"] / out["sync"]["tokens_per_s"] for m in out}
    measured = {m: med[m]["tokens_per_s"] / med["sync"]["tokens_per_s"] for m in out}
    return {
        "predicted_over_sync": predicted,
        "measured_over_sync": measured,
        "relative_error": {m: predicted[m] / measured[m] - 1 for m in out},
        "phase_costs": {
            k: getattr(sim, k) for k in ("step_s", "train_s_per_token", "push_s_per_gb", "chunk")
        },
    }


def main() -> None:
    config = common.parse_config(parser())
    args = SimpleNamespace(**config)
    lengths = json.loads(Path(args.lengths).read_text()) if args.lengths else None
    record: dict[str, Any] = {
        "assumptions": {k: v for k, v in config.items() if k not in ("out", "calibrate")}
    }
    if args.calibrate:
        record["calibration"] = calibrate(args)
        print("calibration:", json.dumps(record["calibration"], indent=1))
    record["predictions"] = [simulate(args, gpus, lengths) for gpus in args.gpus]
    print(
        f"{'GPUs':>5} {'mode':<16} {'tok/s':>10} {'x sync':>7} {'idle':>6} {'quiesce s':>10} {'stale-1':>8}"
    )
    for row in record["predictions"]:
        for mode in ("sync", "async_quiesce", "async_interrupt"):
            r = row[mode]
            idle = "-" if r["engine_idle"] is None else f"{r['engine_idle']:.2f}"
            print(
                f"{row['gpus']:>5} {mode:<16} {r['tokens_per_s']:>10.0f} {r['over_sync']:>7.2f} {idle:>6} {r['quiesce_s']:>10.1f} {r['token_staleness'][1]:>8.3f}"
            )
    out = common.write_results(record, args.out, indent=1, config=config)
    print(json.dumps({"out": str(out)}))


if __name__ == "__main__":
    main()
