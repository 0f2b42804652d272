"""The analysis and figure of ``step_overhead.py``: the timers' keys grouped into the components of a
step (which partition it), the fixed overhead, the tables, the plot (``python benchmarks/plot.py``
redraws it from the results JSON). A helper module (no ``main``)."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import common

# timer key (step_overhead_timers.TARGETS) -> component of the breakdown
COMPONENTS = {
    "rollout.launch": "ray round trip",
    "rollout.poll": "ray round trip",
    "rollout.wait": "ray round trip",
    "rollout.next_batch": "rollout loop bookkeeping + stats",
    "rollout.drain": "rollout loop bookkeeping + stats",
    "rollout.collate": "collate",
    "batch.to_device": "batch to device",
    "train.step": "training_step python (own)",
    "train.update": "training_step python (own)",
    "train.optimizers": "training_step python (own)",
    "train.prepare": "train: advantages",
    "train.forward": "train: forward + log-probs + entropy",
    "train.policy_loss": "train: loss + metrics",
    "train.loss": "train: loss + metrics",
    "train.backward": "train: backward",
    "train.grad_norm_log": "train: extra grad norm (logged)",
    "train.clip": "train: clip_gradients",
    "train.optimizer_step": "train: optimizer step",
    "train.zero_grad": "train: zero_grad",
    "log.step_metrics": "logging: log_step_metrics (own)",
    "log.self_log": "logging: self.log / log_dict",
    "log.self_log_dict": "logging: self.log / log_dict",
    "log.tensorboard": "logging: TensorBoard write",
    "log.histogram": "logging: staleness histogram",
    "sync.weights": "weight push: bookkeeping",
    "sync.quiesce": "wait for generation: quiesce before the push",
    "sync.ping": "weight push: ping workers (ensure_alive)",
    "sync.push": "weight push: pack, put, workers load",
}
TRAIN_COMPUTE = (
    "train: advantages",
    "train: forward + log-probs + entropy",
    "train: loss + metrics",
    "train: backward",
    "train: clip_gradients",
    "train: optimizer step",
    "train: zero_grad",
)


def derive(run: dict[str, Any]) -> None:
    """Add the breakdowns (mean and median over steps), the fixed overhead and the ``self.log``
    figures to a timed run."""
    run["breakdown"] = breakdown(run)
    run["fixed_overhead_ms"] = fixed_overhead(run, run["breakdown"])
    run["breakdown_median"] = breakdown_median(run)
    calls = run["calls_per_step"].get("log.self_log", 0.0)
    own = run["own_ms"].get("log.self_log", 0.0) + run["own_ms"].get("log.self_log_dict", 0.0)
    run["self_log_calls_per_step"] = calls
    run["self_log_ms_per_call"] = own / calls if calls else None


def breakdown_median(run: dict[str, Any]) -> dict[str, float]:
    """The median over steps of each component (robust to the stalls of a shared machine; unlike the
    means, the medians need not add up to the median step)."""
    per_step = [breakdown({"mode": run["mode"], **p}) for p in run["per_step"]]
    keys = {k for b in per_step for k in b}
    med = {k: statistics.median(b.get(k, 0.0) for b in per_step) for k in keys}
    med["= step"] = statistics.median(p["step_ms"] for p in run["per_step"])
    med["fixed overhead"] = statistics.median(
        fixed_overhead({"mode": run["mode"], **p}, b) for p, b in zip(run["per_step"], per_step)
    )
    return dict(sorted(med.items(), key=lambda kv: -kv[1]))


def breakdown(run: dict[str, Any]) -> dict[str, float]:
    """ms per step per component (the components partition the step)."""
    comp: dict[str, float] = defaultdict(float)
    for key, ms in run["own_ms"].items():
        name = COMPONENTS.get(key)
        if name is None and key.startswith("callback."):
            name = f"callback {key.split('.', 1)[1]} (own)"
        comp[name or key] += ms
    gen, score = run["worker_ms"]["generate"], run["worker_ms"]["score"]
    comp["worker: generate"] = gen
    comp["worker: score"] = score
    if run["mode"] == "sync":  # the driver waited for the whole generation: the rest is Ray's
        comp["ray round trip"] -= gen + score
    else:
        comp["wait for generation (not hidden)"] = comp.pop("ray round trip")
        comp["worker: generate"] = 0.0  # overlapped with training: on the step's path only through the wait
        comp["worker: score"] = 0.0
        comp["(worker generate, overlapped)"] = gen
    covered = sum(v for k, v in comp.items() if not k.startswith("("))
    comp["lightning loop (rest)"] = run["step_ms"] - covered
    return dict(sorted(comp.items(), key=lambda kv: -kv[1]))


def fixed_overhead(run: dict[str, Any], comp: dict[str, float]) -> float:
    """Step - generation on the step's path (sync: the worker's generate + score; async: the waits
    for generation, the quiesce before the push included) - train compute."""
    compute = sum(comp.get(k, 0.0) for k in TRAIN_COMPUTE)
    if run["mode"] == "sync":
        return run["step_ms"] - comp["worker: generate"] - comp["worker: score"] - compute
    waits = sum(v for k, v in comp.items() if k.startswith("wait for generation"))
    return run["step_ms"] - waits - compute


def print_medians(runs: dict[str, dict[str, Any]]) -> None:
    timed = {n: r for n, r in runs.items() if "breakdown_median" in r}
    names = list(timed)
    keys: list[str] = []
    for r in timed.values():
        keys += [k for k in r["breakdown_median"] if k not in keys and r["breakdown_median"][k] >= 0.05]
    print("\nmedian over steps (robust to stalls), ms:")
    print(f"{'component':<42}" + "".join(f"{n:>14}" for n in names))
    for k in keys:
        print(f"{k:<42}" + "".join(f"{timed[n]['breakdown_median'].get(k, 0.0):>14.2f}" for n in names))


def print_breakdown(runs: dict[str, dict[str, Any]]) -> None:
    timed = {n: r for n, r in runs.items() if "breakdown" in r}
    names = list(timed)
    keys: list[str] = []
    for r in timed.values():
        keys += [k for k in r["breakdown"] if k not in keys]
    print(f"{'ms per step':<42}" + "".join(f"{n:>14}" for n in names))
    for k in keys:
        print(f"{k:<42}" + "".join(f"{timed[n]['breakdown'].get(k, 0.0):>14.2f}" for n in names))
    print(f"{'= step':<42}" + "".join(f"{timed[n]['step_ms']:>14.2f}" for n in names))
    print(
        f"{'fixed overhead (step - generate - compute)':<42}"
        + "".join(f"{timed[n]['fixed_overhead_ms']:>14.2f}" for n in names)
    )


def print_profiles(runs: dict[str, dict[str, Any]]) -> None:
    """The ``self.log`` figures, and the tables of the profile runs that ran."""
    for n, r in runs.items():
        if r.get("self_log_calls_per_step"):
            print(
                f"  {n}: {r['self_log_calls_per_step']:.0f} self.log calls per step, "
                f"{r['self_log_ms_per_call']:.3f} ms each"
            )
        if r.get("missing"):
            print(f"  {n}: not timed (moved or gone): {', '.join(r['missing'])}")
    if "sync-cprofile" in runs:
        print(
            "\ncProfile, sync-full, top functions by own time (ms per step; cProfile inflates Python-heavy code):"
        )
        for row in runs["sync-cprofile"]["cprofile"][:20]:
            print(
                f"  {row['own_ms_per_step']:>7.2f} own {row['cum_ms_per_step']:>8.2f} cum "
                f"{row['calls_per_step']:>7.1f} calls  {row['function']}"
            )
    if "train-profile" in runs:
        tp = runs["train-profile"]
        print(f"\ntrain step, {tp['workload']} workload (torch.profiler, ms per step, CPU total by label):")
        for row in tp["torch_profile"]["labels"]:
            print(f"  {row['cpu_ms_per_step']:>8.2f}  {row['name']}")
        print("  top ops by self CPU:")
        for row in tp["torch_profile"]["top_ops"][:15]:
            print(
                f"  {row['self_cpu_ms_per_step']:>8.2f}  {row['calls_per_step']:>6.1f} calls  {row['name']}"
            )
    if "push-variants" in runs:
        pv = runs["push-variants"]
        print(
            f"\nweight push alone, tiny model ({pv['bytes'] / 1e6:.2f} MB in {pv['tensors']} tensors), ms (median):"
        )
        for k, v in pv["ms"].items():
            print(f"  {v:>8.2f}  {k}")


def final_line(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Step and fixed overhead per timed run, and the push figures, for the final JSON line."""
    final: dict[str, Any] = {
        n: {
            "step_ms": round(r["step_ms"], 2),
            "fixed_overhead_ms": round(r["fixed_overhead_ms"], 2) if "fixed_overhead_ms" in r else None,
        }
        for n, r in runs.items()
        if "step_ms" in r
    }
    if "push-variants" in runs:
        final["push_ms"] = {k: round(v, 2) for k, v in runs["push-variants"]["ms"].items()}
    return final


def plot(results: dict[str, Any], path: Path) -> None:
    """Stacked bars: ms per step per component, for each timed run."""
    runs = {n: r for n, r in results["runs"].items() if "breakdown" in r}
    groups = {
        "worker generate + score": lambda k: k.startswith("worker:"),
        "wait for generation": lambda k: k.startswith("wait for generation"),
        "train compute": lambda k: k in TRAIN_COMPUTE,
        "ray round trip": lambda k: k == "ray round trip",
        "weight push": lambda k: k.startswith("weight push"),
        "logging": lambda k: k.startswith("logging") or "WeightVersionLogger" in k or "ProgressBar" in k,
        "eval": lambda k: "RolloutEvalCallback" in k,
        "collate + rollout loop": lambda k: (
            k.startswith("collate") or k.startswith("rollout loop") or k == "batch to device"
        ),
        "training_step python + extra norm": lambda k: (
            k.startswith("training_step") or "extra grad norm" in k
        ),
        "lightning loop + other callbacks": lambda k: True,
    }
    colors = [
        "#9aa5b1",
        "#c9ccd1",
        "#2f80ed",
        "#eb5757",
        "#f2994a",
        "#bb6bd9",
        "#56ccf2",
        "#6fcf97",
        "#f2c94c",
        "#333333",
    ]
    panels = [
        ("tiny: 8x8x3 tokens, h128 L2", {n: r for n, r in runs.items() if r["workload"] == "tiny"}),
        ("issue 11: 16x8x16, h128 L4", {n: r for n, r in runs.items() if r["workload"] != "tiny"}),
    ]
    panels = [(title, rs) for title, rs in panels if rs]
    fig, axes = common.pyplot().subplots(
        1,
        len(panels),
        figsize=(3 + 1.6 * len(runs), 4),
        squeeze=False,
        gridspec_kw={"width_ratios": [max(1, len(rs)) for _, rs in panels]},
    )
    for ax, (title, panel_runs) in zip(axes[0], panels):
        bottoms = [0.0] * len(panel_runs)
        for label, color in zip(groups, colors):
            values = []
            for r in panel_runs.values():
                total = 0.0
                for k, v in r["breakdown"].items():
                    if k.startswith("("):
                        continue
                    if next(g for g, f in groups.items() if f(k)) == label:
                        total += v
                values.append(total)
            ax.bar(list(panel_runs), values, bottom=bottoms, label=label, color=color)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        for i, r in enumerate(panel_runs.values()):
            ax.text(
                i,
                bottoms[i],
                f"{r['step_ms']:.0f} ms\nfixed {r['fixed_overhead_ms']:.0f}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(0, max(bottoms) * 1.25)
    axes[0][0].set_ylabel("ms per step (mean)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(
        f"Where a GRPO step's time goes (2 CPU cores; target fixed overhead <= {results['target_ms']:.0f} ms)",
        fontsize=9,
    )
    common.save_figure(fig, path)
