"""The analysis and figure of ``time_to_accuracy.py``: curves on a common grid (median and range over
seeds), the time and samples to each held-out accuracy target, the table, the plot (``python
benchmarks.harness.plot`` redraws it from the results JSON). A helper module (no ``main``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness import figures, stats

TARGETS = (0.2, 0.3, 0.4, 0.5)


def first_reach(curve: list[dict], target: float, key: str) -> float | None:
    for point in curve:
        if point["heldout_accuracy"] >= target - 1e-9:
            return point[key]
    return None


def step_curve(curve: list[dict], x_key: str, y_key: str, grid: list[float]) -> list[float | None]:
    """``y`` of the last point with ``x <= g`` for every grid value ``g`` (None before the first)."""
    out, i, current = [], 0, None
    points = [p for p in curve if p.get(y_key) is not None]
    for g in grid:
        while i < len(points) and points[i][x_key] <= g + 1e-9:
            current = points[i][y_key]
            i += 1
        out.append(current)
    return out


def band(curves: list[list[dict]], x_key: str, y_key: str, grid: list[float]) -> dict[str, list]:
    """Median and range over seeds on a common grid (up to where every seed has data)."""
    columns = [step_curve(c, x_key, y_key, grid) for c in curves]
    end = min(max((p[x_key] for p in c), default=0.0) for c in curves)
    med, lo, hi, xs = [], [], [], []
    for j, g in enumerate(grid):
        if g > end + 1e-9:
            break
        values = [col[j] for col in columns if col[j] is not None]
        if not values:
            continue
        s = stats.spread(values)
        xs.append(g)
        med.append(s["median"])
        lo.append(s["min"])
        hi.append(s["max"])
    return {"x": xs, "median": med, "min": lo, "max": hi}


def summarize(runs: list[dict[str, Any]], configs: list[str], config: dict[str, Any]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    time_grid = [round(0.5 * i, 2) for i in range(int(config["budget_s"] / 0.5) + 2)]
    for name in configs:
        mine = sorted((r for r in runs if r["name"] == name), key=lambda r: r["seed"])
        if not mine:
            continue
        curves = [r["curve"] for r in mine]
        max_samples = max(p["samples"] for c in curves for p in c)
        sample_step = max(64, (max_samples // 100) // 64 * 64)
        sample_grid = list(range(0, max_samples + sample_step, sample_step))
        entry = {
            "seeds": [r["seed"] for r in mine],
            "steps": stats.spread([r["steps"] for r in mine]),
            "steps_per_s": stats.spread([r["steps_per_s"] for r in mine]),
            "ms_per_step": stats.spread([r["ms_per_step"] for r in mine]),
            "final_heldout_accuracy": stats.spread([r["curve"][-1]["heldout_accuracy"] for r in mine]),
            "best_heldout_accuracy": stats.spread([max(p["heldout_accuracy"] for p in c) for c in curves]),
            "final_train_accuracy": stats.spread([r["curve"][-1]["train_accuracy"] for r in mine]),
            "completion_tokens_per_step": stats.spread([r["completion_tokens_per_step"] for r in mine]),
            "time_to": {},
            "samples_to": {},
            "curves": {
                "heldout_vs_time": band(curves, "t", "heldout_accuracy", time_grid),
                "heldout_vs_samples": band(curves, "samples", "heldout_accuracy", sample_grid),
                "reward_vs_time": band(curves, "t", "train_reward", time_grid),
                "reward_vs_samples": band(curves, "samples", "train_reward", sample_grid),
            },
        }
        for target in sorted({*TARGETS, *([config["target"]] if config["target"] else [])}):
            entry["time_to"][str(target)] = stats.spread([first_reach(c, target, "t") for c in curves])
            entry["time_to"][str(target)]["per_seed"] = [first_reach(c, target, "t") for c in curves]
            entry["samples_to"][str(target)] = stats.spread(
                [first_reach(c, target, "samples") for c in curves]
            )
        summary[name] = entry
    return summary


def choose_target(summary: dict[str, Any], requested: float | None) -> float:
    """``requested``, or (auto) the highest of ``TARGETS`` that every configuration reaches in at
    least half of its seeds (so every median time is defined); the lowest if none is."""
    if requested:
        return requested
    reached = [
        t
        for t in TARGETS
        if all(
            2 * sum(v is not None for v in s["time_to"][str(t)]["per_seed"])
            >= len(s["time_to"][str(t)]["per_seed"])
            for s in summary.values()
        )
    ]
    return max(reached) if reached else min(TARGETS)


def print_table(summary: dict[str, Any], target: float) -> None:
    key = str(target)
    fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
    print(
        f"{'config':<9} {'ms/step':>8} {'steps':>6} {'final acc':>10} {'range':>10} "
        f"{'t->' + key + ' s':>9} {'range':>12} {'samples->' + key:>12} {'seeds reached':>13}"
    )
    for name, s in summary.items():
        t = s["time_to"][key]
        reached = sum(v is not None for v in t["per_seed"])
        print(
            f"{name:<9} {s['ms_per_step']['median']:>8.1f} {s['steps']['median']:>6.0f} "
            f"{s['final_heldout_accuracy']['median']:>10.2f} "
            f"{s['final_heldout_accuracy']['min']:>4.2f}-{s['final_heldout_accuracy']['max']:<5.2f} "
            f"{fmt(t['median']):>9} {fmt(t['min']):>5}-{fmt(t['max']):<6} "
            f"{fmt(s['samples_to'][key]['median'], '{:.0f}'):>12} {reached:>6}/{len(t['per_seed'])}"
        )


def plot(results: dict[str, Any], path: Path) -> None:
    """Held-out greedy accuracy and training reward against seconds and samples (median, range)."""
    summary, config = results["summary"], results["config"]
    colors = {"trl": "#7f8c8d", "sync": "#2f80ed", "async-s1": "#27ae60", "async-s2": "#e67e22"}
    fig, axes = figures.pyplot().subplots(2, 2, figsize=(10, 6.5))
    panels = [
        ("heldout_vs_time", "training wall-clock (s)", "held-out greedy accuracy"),
        ("heldout_vs_samples", "samples trained", "held-out greedy accuracy"),
        ("reward_vs_time", "training wall-clock (s)", "training reward"),
        ("reward_vs_samples", "samples trained", "training reward"),
    ]
    for ax, (key, xlabel, ylabel) in zip(axes.flat, panels):
        for name, s in summary.items():
            c = s["curves"][key]
            ax.plot(c["x"], c["median"], color=colors.get(name), label=name, drawstyle="steps-post")
            ax.fill_between(c["x"], c["min"], c["max"], color=colors.get(name), alpha=0.15, step="post")
        if key.startswith("heldout"):
            ax.axhline(config["target"], color="k", lw=0.8, ls="--")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        f"add_mod10 (80/20 split), tiny Llama h128 L2, {config['prompts']}x{config['group']}x"
        f"{config['max_new_tokens']} tok, lr {config['lr']:g}; median and range of {len(config['seeds'])} seeds; "
        f"TRL {config.get('trl', '')}",
        fontsize=9,
    )
    figures.save_figure(fig, path)


def final_line(summary: dict[str, Any], target: float) -> dict[str, Any]:
    """The per-configuration figures of the final JSON line, at ``target``."""
    key = str(target)
    return {
        name: {
            "ms_per_step": round(s["ms_per_step"]["median"], 1),
            "final_heldout_accuracy": s["final_heldout_accuracy"]["median"],
            f"time_to_{key}_s": s["time_to"][key]["median"],
            f"samples_to_{key}": s["samples_to"][key]["median"],
            "seeds_reached": sum(v is not None for v in s["time_to"][key]["per_seed"]),
        }
        for name, s in summary.items()
    }
