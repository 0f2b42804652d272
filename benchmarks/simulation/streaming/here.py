"""Calibration on this machine: the streaming simulator against the real long-tail runs.

Inputs, all measured here, none fitted to the runs being predicted:

* the engine: ``a + b*rows + c*context`` and prefill per token, fitted on the continuous HF engine's own
  decode steps (``benchmarks/results/engine_step_cost.json``, ``performance/engine_step_cost.py``);
* the workloads (``performance/interrupt_long_tail.py``): 16 prompts x 8 samples a step,
  ``max_staleness 1``, ``max_inflight 2`` (32 groups), with 128 engine slots (``interrupt_long_tail_groups``:
  the trainer is the slower side) or 16 (``interrupt_long_tail_slots16``: the engine is; ``_lr0``: the
  same with the policy held fixed, so every mode generates the untrained long-tail lengths); the completion
  lengths each mode trained (drawn with replacement), the trainer's update seconds per trained token
  (``perf/train_time_s`` over the step's tokens) and the push seconds.

Predicted against measured: steps per second and engine occupancy, for ``async_groups`` (the sync
drains in-flight groups) and ``async_groups_continue`` (pushes land between decode steps, rows go on in
place), under two trainer models: the update alone, and the update plus the rest of the measured step
(the loop's own work: rewards, collation, Ray calls, logging). :func:`window` checks the staleness
window against runs that recorded the starved slots. Standard library only.
"""

from __future__ import annotations

import json
import statistics
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks.simulation.streaming import World
from benchmarks.simulation.streaming.trainer import run

RESULTS = Path(__file__).resolve().parents[2] / "results"
MODES = {"async_groups": True, "async_groups_continue": False}  # mode -> drains before a sync
WORKLOADS = {  # results file -> (how it was made, what bounds it)
    "interrupt_long_tail_groups": (
        "interrupt_long_tail --modes async_groups async_groups_continue",
        "trainer",
    ),
    "interrupt_long_tail_slots16": (
        "interrupt_long_tail --slots 16 --out interrupt_long_tail_slots16",
        "engine",
    ),
    # the same with the policy held fixed (--lr 0): every mode generates the untrained long-tail lengths
    "interrupt_long_tail_slots16_lr0": (
        "interrupt_long_tail --slots 16 --lr 0 --out interrupt_long_tail_slots16_lr0",
        "engine",
    ),
}

# runs that recorded the starved slots (rollout/engine_starved) -> interrupt_long_tail's arguments
WINDOW = {
    "interrupt_long_tail_split_slots16": "--slots 16",
    "interrupt_long_tail_split_slots32_lr0": "--slots 32 --lr 0",
}
WINDOW_MODES = {"async_groups_continue": 1, "async_groups_continue_s2": 2}  # mode -> max_staleness


def load(name: str, command: str) -> dict[str, Any]:
    path = RESULTS / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run python -m benchmarks.performance.{command}")
    return json.loads(path.read_text())


def calibrate_here(seed: int = 0, steps: int = 300, warmup: int = 20, joins: bool = True) -> dict[str, Any]:
    """Both workloads predicted; ``joins=False`` leaves out the HF engine's refill (every freed slot
    refilled at once, joins free), the comparison docs/benchmarks.md quotes."""
    engine = load("engine_step_cost", "engine_step_cost")["summary"]
    workloads = {name: (load(name, command), bound) for name, (command, bound) in WORKLOADS.items()}
    rows = []
    for name, (workload, bound) in workloads.items():
        rows += predict(engine, name, workload, bound, seed, steps, warmup, joins)
    return {
        "engine": {k: engine[k] for k in ("a", "b", "c", "prefill_s_per_token", "prompt_len")},
        "workloads": {name: workload["summary"]["config"] for name, (workload, _) in workloads.items()},
        "table": rows,
        "engine_alone": {name: engine_alone(engine, w, seed, joins) for name, (w, _) in workloads.items()},
        "window": window(engine, seed, steps, warmup),
    }


def window(engine: dict[str, Any], seed: int, steps: int, warmup: int) -> list[dict[str, Any]]:
    """The staleness window against runs that recorded the engine's starved slots: occupancy and starved
    share at ``max_staleness`` 1 and 2, from the engine's own costs (learning at 16 slots, and equal work
    at 32 slots, where the engine outpaces the trainer)."""
    rows = []
    for name, command in WINDOW.items():
        workload = load(name, f"interrupt_long_tail {command} --out {name}")
        config = workload["summary"]["config"]
        for mode, staleness in WINDOW_MODES.items():
            measured = workload["summary"]["medians"][mode]
            lengths = [n for r in workload["runs"] if r["mode"] == mode for n in r["completion_lengths"]]
            overhead = overhead_of(measured)
            cfg = mode_cfg(engine, config, measured, lengths, False, seed, steps, warmup, True, overhead, 1.0)
            cfg.max_staleness = cfg.evict_staleness = staleness
            cfg.max_inflight = (staleness + 1) * config["batch"]
            sim = run(cfg)
            row = dict(workload=name, mode=mode, max_staleness=staleness)
            row["occupancy"] = compared(measured["engine_occupancy"], sim["occupancy"])
            row["starved"] = compared(measured["engine_starved"], sim["engine_starved"])
            rows.append({**row, "steps_per_s": compared(measured["steps_per_s"], 1.0 / sim["s_per_batch"])})
    return rows


def slots_of(config: dict[str, Any]) -> int:
    return config.get("slots") or config["batch"] * config["group"]


def engine_cfg(engine: dict[str, Any], slots: int, joins: bool, scale: float = 1.0) -> dict[str, Any]:
    """The simulated HF continuous engine: the measured step costs (times ``scale``), ``slots`` rows,
    no KV bound, and (``joins``) its refill: a finished row's slot refilled at once (``refill_at`` 1)
    from a stage that one forward fills with ``slots`` queued rows at a time (the batcher's ``stage``; a
    unit test pins the two together)."""
    return {
        **{k: scale * engine[k] for k in ("a", "b", "c")},
        "prefill": scale * engine["prefill_s_per_token"],
        "max_rows": slots,
        "kv_tokens": 1 << 40,
        "per_call": False,
        "resume_prefill": 0.0,
        "join_s": scale * engine["a"] if joins else 0.0,
        "refill_s": scale * engine.get("refill_s_per_row", 0.0) if joins else 0.0,
        "refill_at": 1,
        "stage": joins,
        "padded": joins,
    }


def engine_alone(
    engine: dict[str, Any], workload: dict[str, Any], seed: int, joins: bool
) -> dict[str, float]:
    """Generation alone (``generation_throughput`` of interrupt_long_tail: 4 steps' groups at once on one
    continuous engine, no trainer): completion tokens/s simulated against measured, on the lengths that
    measurement generated (files written before it recorded them: the streaming modes' lengths)."""
    config = workload["summary"]["config"]
    lengths = workload["summary"].get("generation_lengths") or [
        n for r in workload["runs"] if r["mode"] in MODES for n in r["completion_lengths"]
    ]
    world = World(
        SimpleNamespace(
            **engine_cfg(engine, slots_of(config), joins),
            seed=seed,
            median_len=1,
            sigma=0.0,
            max_new_tokens=config["max_new_tokens"],
            prompt_len=int(engine["prompt_len"]),
            samples=config["group"],
            lengths=lengths,
        ),
        1,
    )
    groups = [world.new_group(i) for i in range(4 * config["batch"])]
    for group in groups:
        world.add(group)
    for group in groups:
        world.run_until(group)
    simulated = sum(row.target for group in groups for row in group.rows) / world.now
    measured = workload["summary"]["generation_tokens_per_s"]["continuous"]
    return {"measured": measured, "simulated": simulated, "error": simulated / measured - 1}


def predict(
    engine: dict[str, Any],
    name: str,
    workload: dict[str, Any],
    bound: str,
    seed: int,
    steps: int,
    warmup: int,
    joins: bool,
) -> list[dict[str, Any]]:
    """One workload's rows: each streaming mode x trainer model, simulated against measured. The third
    model (where the run recorded ``engine_step_ms``) takes the engine's step cost from the run itself:
    the measured costs scaled by the run's mean step over the simulated one. It is not a prediction; it
    splits the error into the step cost (the cores shared with the trainer and Ray) and the rest
    (admission, refill, reaping: what the simulator models)."""
    config = workload["summary"]["config"]
    rows = []
    for mode, drains in MODES.items():
        measured = workload["summary"]["medians"][mode]
        lengths = [n for r in workload["runs"] if r["mode"] == mode for n in r["completion_lengths"]]
        cfg_for = partial(mode_cfg, engine, config, measured, lengths, drains, seed, steps, warmup, joins)
        models = [("update only", 0.0, 1.0), ("update + measured overhead", overhead_of(measured), 1.0)]
        sims = [run(cfg_for(overhead, scale)) for _, overhead, scale in models]
        if measured.get("engine_step_ms"):  # the run's step cost: scaled by its step over the simulated one
            scale = measured["engine_step_ms"] / sims[1]["engine_step_ms"]
            models.append(("update + overhead, the run's step cost", models[1][1], scale))
            sims.append(run(cfg_for(models[1][1], scale)))
        for (trainer, overhead, scale), sim in zip(models, sims):
            steps_per_s = 1.0 / sim["s_per_batch"]
            rows.append(
                {
                    "workload": name,
                    "bound": bound,
                    "mode": mode,
                    "trainer": trainer,
                    "steps_per_s": compared(measured["steps_per_s"], steps_per_s),
                    "occupancy": compared(measured["engine_occupancy"], sim["occupancy"]),
                    "engine_busy": compared(measured.get("engine_busy"), sim["engine_busy"]),
                    "engine_step_ms": compared(measured.get("engine_step_ms"), sim["engine_step_ms"]),
                    "wait_s": {
                        "measured": measured["wait_s"],
                        "simulated": sim["phases_s_per_batch"]["wait"],
                    },
                    "overhead_s": overhead,
                    "step_cost_scale": scale,
                }
            )
    return rows


def overhead_of(measured: dict[str, Any]) -> float:
    """The rest of a measured step that is neither update, wait, drain nor push (the loop's own work)."""
    period = 1.0 / measured["steps_per_s"]
    rest = period - measured["train_s"] - measured["wait_s"] - measured["quiesce_s"] - measured["push_s"]
    return max(0.0, rest)


def compared(measured: float | None, simulated: float) -> dict[str, Any]:
    """``{"measured", "simulated", "error"}`` (error None where nothing was measured)."""
    error = simulated / measured - 1 if measured else None
    return {"measured": measured, "simulated": simulated, "error": error}


def mode_cfg(
    engine: dict[str, Any],
    config: dict[str, Any],
    measured: dict[str, Any],
    lengths: list[int],
    drains: bool,
    seed: int,
    steps: int,
    warmup: int,
    joins: bool,
    overhead: float,
    scale: float,
) -> SimpleNamespace:
    """One measured mode as the simulator runs it: its lengths, update cost per token, push seconds
    and (``overhead``) the rest of its measured step; the engine's costs times ``scale``."""
    prompt_len = int(engine["prompt_len"])
    tokens_per_step = config["batch"] * config["group"] * (prompt_len + statistics.fmean(lengths))
    return SimpleNamespace(
        mode="async",
        prompt_len=prompt_len,
        samples=config["group"],
        lengths=lengths,
        median_len=1,
        sigma=0.0,
        max_new_tokens=config["max_new_tokens"],
        seed=seed,
        tp=1,
        **engine_cfg(engine, slots_of(config), joins, scale),
        sync_recompute=False,
        async_recompute=False,
        push_s=measured["push_s"],
        quiesce=drains,
        groups_per_step=config["batch"],
        sync_interval=1,
        steps=steps,
        warmup=warmup,
        gen_gpus=1,
        train_gpus=1,
        max_staleness=1,
        evict_staleness=1,
        max_inflight=2 * config["batch"],
        amdahl=0.0,
        train_efficiency=1.0,
        update_s_per_token=measured["train_s"] / tokens_per_step,
        recompute_s_per_token=0.0,
        step_overhead_s=overhead,
    )


def print_here(record: dict[str, Any]) -> dict[str, Any]:
    """Print the calibration's table; ``record`` back."""
    print(
        f"{'bound':<7} {'mode':<22} {'trainer':<39} {'steps/s':>8} {'sim':>6} {'error':>6} "
        f"{'occupancy':>9} {'sim':>6} {'busy':>5} {'sim':>5} {'step ms':>7} {'sim':>5}"
    )
    for row in record["table"]:
        sp, oc, busy, ms = row["steps_per_s"], row["occupancy"], row["engine_busy"], row["engine_step_ms"]
        print(
            f"{row['bound']:<7} {row['mode']:<22} {row['trainer']:<39} {sp['measured']:>8.2f} "
            f"{sp['simulated']:>6.2f} {sp['error']:>+6.0%} {oc['measured']:>9.3f} {oc['simulated']:>6.3f} "
            f"{busy['measured'] or float('nan'):>5.2f} {busy['simulated']:>5.2f} "
            f"{ms['measured'] or float('nan'):>7.2f} {ms['simulated']:>5.2f}"
        )
    for row in record.get("window", []):
        oc, st = row["occupancy"], row["starved"]
        print(
            f"window {row['workload']} staleness {row['max_staleness']}: occupancy {oc['measured']:.3f} "
            f"measured, {oc['simulated']:.3f} simulated; starved {st['measured']:.3f}, {st['simulated']:.3f}"
        )
    for name, alone in record["engine_alone"].items():
        print(
            f"generation alone, {name}: {alone['measured']:.0f} tokens/s measured, "
            f"{alone['simulated']:.0f} simulated ({alone['error']:+.0%})"
        )
    return record
