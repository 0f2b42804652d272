"""Two more checks against verl's published fully-async runs (``docs/advance/fully_async.md``), beside
the phase table of :mod:`calibrate`:

* **The staleness ablation** ("128-card Stale Ablation Experiment": 64:64, ``partial_rollout`` on,
  ``staleness_threshold`` 0 / 0.1 / 0.3 / 0.5). The same calibrated config as the phase table (costs
  from the sync column only) is run with verl's launch ceiling at each threshold. Nothing is fitted to
  these rows. The wait for samples as a share of the wait at 0.5 tests the launch rules apart from the
  engines' absolute speed.
* **The runs' own spread.** The tables give each run's total time after 100, 200, 300 and 400 steps.
  Differences give the seconds a step in each 100-step window: the step time grows as the completions
  lengthen during training, so a published per-step mean depends on the window it averages over. The
  64:64 run appears twice (the main table over 400 steps, the ``require_batches`` table over 300: the
  same totals), at 150.63 and 124.64 s a step.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

from benchmarks.simulation.streaming.calibrate import PUBLISHED, async_over, calibrate, implied_mfu, phases
from benchmarks.simulation.streaming.trainer import run

PHASES = ("step", "gen", "update_actor")
ABLATION = {  # staleness_threshold -> seconds per step of 512 prompts (the trainer's phases)
    0.0: {"step": 231.34, "gen": 128.47, "update_actor": 98.77},
    0.1: {"step": 171.30, "gen": 58.17, "update_actor": 109.12},
    0.3: {"step": 146.11, "gen": 38.88, "update_actor": 103.22},
    0.5: {k: PUBLISHED["async_64_64"][k] for k in PHASES},  # the phase table's async row
}
TOTALS = {  # total time after 100 / 200 / 300 / 400 steps, as published
    "sync_128": ("8h 36m", "17h 56m", "1d 5h 6m", "1d 16h 48m"),
    "async_64_64": ("3h 13m", "6h 46m", "10h 53m", "17h 22m"),
}
SAME_RUN_300_STEPS = {"step": 124.64, "gen": 25.62, "update_actor": 95.06}  # require_batches 4
SYNC_ROWS = {  # colocated sync at each GPU count: one run each (the main table)
    128: PUBLISHED["sync_128"],
    64: PUBLISHED["sync_64"],
    32: {"step": 790.10, "gen": 357.41, "old_log_prob": 107.71, "update_actor": 269.80},
}
OVERHEAD_S = 10.0  # seconds of verl's sync gen timer counted as not decoding, a sensitivity


def seconds(total: str) -> float:
    """``"1d 5h 6m"`` in seconds."""
    units = {"d": 86400, "h": 3600, "m": 60}
    return float(sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([dhm])", total)))


def run_windows() -> dict[str, Any]:
    """Seconds a step in each 100-step window of the published runs, and their mean over 300 and 400."""
    out = {}
    for mode, totals in TOTALS.items():
        ends = [seconds(t) for t in totals]
        out[mode] = {
            "s_per_step_by_100": [(b - a) / 100 for a, b in zip([0.0] + ends, ends, strict=False)],
            "mean_300": ends[2] / 300,
            "mean_400": ends[3] / 400,
        }
    sync, asyn = out["sync_128"], out["async_64_64"]
    out["speedup_by_100"] = [
        s / a for s, a in zip(sync["s_per_step_by_100"], asyn["s_per_step_by_100"], strict=True)
    ]
    out["same_run_300_steps"] = SAME_RUN_300_STEPS
    return out


def sync_rows(cfg: SimpleNamespace) -> list[dict[str, Any]]:
    """The calibrated config (engine costs fitted at 128 GPUs) run colocated at 64 and 32 GPUs against
    verl's own sync rows: how far one steady engine cost is from verl's runs at other GPU counts."""
    rows = []
    for gpus, pub in SYNC_ROWS.items():
        sim = phases(run(SimpleNamespace(**{**vars(cfg), "gen_gpus": gpus, "train_gpus": gpus})), 1)
        rows.append(
            {
                "gpus": gpus,
                **{k: {"published": v, "simulated": sim[k], "error": sim[k] / v - 1} for k, v in pub.items()},
            }
        )
    return rows


def ablation(cfg: SimpleNamespace) -> list[dict[str, Any]]:
    """Each threshold's row (the async run as :func:`calibrate.async_over` sets it): published and
    simulated step, wait and update, their errors, and the wait as a share of the wait at 0.5, published
    and simulated."""
    over = async_over(cfg)
    sim = {
        f: phases(run(SimpleNamespace(**{**vars(cfg), **over, "staleness_fraction": f})), 4) for f in ABLATION
    }
    rows = []
    for f, pub in ABLATION.items():
        row: dict[str, Any] = {"staleness_threshold": f}
        for key in PHASES:
            row[key] = {"published": pub[key], "simulated": sim[f][key], "error": sim[f][key] / pub[key] - 1}
        published = pub["gen"] / ABLATION[0.5]["gen"]
        simulated = sim[f]["gen"] / sim[0.5]["gen"] if sim[0.5]["gen"] > 0 else None  # None: no wait at 0.5
        row["gen_over_gen_at_0.5"] = {
            "published": published,
            "simulated": simulated,
            "error": None if simulated is None else simulated / published - 1,
        }
        rows.append(row)
    return rows


def with_verls_trainer(cfg: SimpleNamespace) -> dict[str, float]:
    """The async 64:64 run with verl's own async update (113.16 s a published step) and push (4.33 s)
    put in by hand: neither can come from the sync column, so this is a check of the engine side under
    verl's launch rules, not a prediction. Returns the step and the wait, and their errors."""
    over = async_over(cfg)
    base = phases(run(SimpleNamespace(**{**vars(cfg), **over})), 4)
    published = PUBLISHED["async_64_64"]
    hand = {
        "update_s_per_token": cfg.update_s_per_token * published["update_actor"] / base["update_actor"],
        "push_s": published["step"] - published["gen"] - published["update_actor"],  # once per sync
    }
    got = phases(run(SimpleNamespace(**{**vars(cfg), **over, **hand})), 4)
    return {
        "step": got["step"],
        "step_error": got["step"] / published["step"] - 1,
        "wait": got["gen"],
        "wait_error": got["gen"] / published["gen"] - 1,
    }


GRID = {"sigma": (1.0, 1.2), "median": (600, 900, 1200, 1800)}


def length_grid(args: Any) -> list[dict[str, Any]]:
    """The unpublished lengths varied (each point a new calibration on the sync column): the wait's
    shape over the thresholds (largest error of the wait as a share of the wait at 0.5; None where the
    trainer never waits at 0.5) against the step and the wait at 0.5, and the update MFU the lengths
    imply."""
    points = []
    for sigma in GRID["sigma"]:
        for median in GRID["median"]:
            costs, cfg = calibrate(
                SimpleNamespace(**{**vars(args), "verl_median_len": median, "verl_sigma": sigma})
            )
            rows = ablation(cfg)
            shape = [r["gen_over_gen_at_0.5"]["error"] for r in rows]
            points.append(
                {
                    "sigma": sigma,
                    "median_len": median,
                    "engine_scale": costs["scale"],
                    "shape_error_max": None if None in shape else max(abs(e) for e in shape),
                    "step_error_at_0.5": rows[-1]["step"]["error"],
                    "gen_error_at_0.5": rows[-1]["gen"]["error"],
                    "tokens_per_step": costs["tokens_per_step"],
                    "implied_update_mfu": implied_mfu(costs["tokens_per_step"]),
                }
            )
    return points


def checks(args: Any, cfg: SimpleNamespace) -> dict[str, Any]:
    """Every check of this module on the calibrated ``cfg`` (``args``: the calibration's), and the
    ablation again under two other calibrations: with :data:`OVERHEAD_S` of the sync gen timer not
    decoding, and with the fixed cost per decode step alone fitted (``--verl-fit fixed``)."""
    overhead, fixed = {"verl_sync_gen_overhead": OVERHEAD_S}, {"verl_fit": "fixed"}
    with_overhead, fixed_fit = (
        calibrate(SimpleNamespace(**{**vars(args), **o}))[1] for o in (overhead, fixed)
    )
    fit = getattr(args, "verl_fit", "all")
    return {
        "staleness_ablation": ablation(cfg),
        "length_grid": length_grid(args),
        "sync_rows": sync_rows(cfg),
        "run_windows": run_windows(),
        "ablation_with_sync_gen_overhead": {**overhead, **ablation_errors(with_overhead)},
        "ablation_with_fixed_fit": {**fixed, **ablation_errors(fixed_fit)},
        "with_verls_trainer": {fit: with_verls_trainer(cfg), "fixed": with_verls_trainer(fixed_fit)},
    }


def ablation_errors(cfg: SimpleNamespace) -> dict[str, list[float | None]]:
    """The ablation's wait errors and shape errors (each threshold's) on ``cfg``."""
    rows = ablation(cfg)
    return {
        "wait_errors": [row["gen"]["error"] for row in rows],
        "shape_errors": [row["gen_over_gen_at_0.5"]["error"] for row in rows],
    }


def report(rep: dict[str, Any]) -> None:
    """Print :func:`checks`' results (merged into :func:`calibrate.reproduce`'s record)."""
    print("staleness ablation (64:64): published / simulated, error; the wait as a share of the wait at 0.5")
    for row in rep["staleness_ablation"]:
        cells = [f"threshold {row['staleness_threshold']:.1f}"]
        for key in ("step", "gen", "update_actor", "gen_over_gen_at_0.5"):
            cell, err = row[key], row[key]["error"]
            sim = "-" if cell["simulated"] is None else f"{cell['simulated']:.2f}"
            cells.append(f"{key} {cell['published']:.2f} / {sim} ({'-' if err is None else f'{err:+.0%}'})")
        print("  " + ", ".join(cells))
    for p in rep["length_grid"]:
        shape = "-" if p["shape_error_max"] is None else f"{p['shape_error_max']:.0%}"
        print(
            f"  lengths sigma {p['sigma']} median {p['median_len']}: shape error {shape}, at 0.5 step"
            f" {p['step_error_at_0.5']:+.0%} wait {p['gen_error_at_0.5']:+.0%}, update MFU {p['implied_update_mfu']:.0%}"
        )
    for key, label in (
        ("ablation_with_sync_gen_overhead", f"{OVERHEAD_S:.0f} s of the sync gen timer not decoding"),
        ("ablation_with_fixed_fit", "the fixed step cost alone fitted"),
    ):
        waits = ", ".join(f"{e:+.0%}" for e in rep[key]["wait_errors"])
        shape = ", ".join("-" if e is None else f"{e:+.0%}" for e in rep[key]["shape_errors"])
        print(f"  {label}: waits {waits}, shape {shape}")
    for fit, got in rep["with_verls_trainer"].items():
        print(
            f"  verl's own async update and push put in by hand, --verl-fit {fit}: step {got['step']:.1f} s"
            f" ({got['step_error']:+.0%}), wait {got['wait']:.1f} s ({got['wait_error']:+.0%})"
        )
    for row in rep["sync_rows"]:
        cells = ", ".join(
            f"{k} {row[k]['published']:.1f} / {row[k]['simulated']:.1f} ({row[k]['error']:+.0%})"
            for k in SYNC_ROWS[128]
        )
        print(f"  colocated sync on {row['gpus']} GPUs: {cells}")
    windows = rep["run_windows"]
    for mode in TOTALS:
        by = ", ".join(f"{s:.0f}" for s in windows[mode]["s_per_step_by_100"])
        print(f"  {mode}: s a step by 100-step window {by}")
    print("  speedup by window " + ", ".join(f"{s:.2f}x" for s in windows["speedup_by_100"]))
