"""Draw the README's benchmark figures from benchmarks/results/*.json, or a run's timeline.

python benchmarks/plot.py
python benchmarks/plot.py --timeline runs/grpo_tiny/version_0/timeline.json   # -> timeline.png beside it
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def bars(path: Path, title: str, labels: list[str], values: list[float], unit: str) -> None:
    fig, ax = plt.subplots(figsize=(5, 3))
    drawn = ax.bar(labels, values, color=["#9aa5b1", "#2f80ed", "#27ae60"][: len(labels)])
    ax.bar_label(drawn, fmt="%.2f")
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def timeline_gantt(trace_path: Path, out: Path | None = None) -> Path:
    """A run's ``timeline.json`` (Chrome trace) as a Gantt chart PNG (default: ``timeline.png`` beside it)."""
    from unirl_lightning.timeline import gantt, read_trace

    trace_path = Path(trace_path)
    out = gantt(
        read_trace(trace_path), out or trace_path.with_suffix(".png"), f"timeline of {trace_path.parent.name}"
    )
    print(f"wrote {out}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--timeline", type=Path, help="draw this run's timeline.json as a Gantt chart instead"
    )
    args = parser.parse_args()
    if args.timeline is not None:
        timeline_gantt(args.timeline)
        return
    path = RESULTS / "async_vs_sync.json"
    if path.is_file():
        s = json.loads(path.read_text())["summary"]
        bars(
            RESULTS / "async_vs_sync.png",
            f"GRPO steps/s on 2 CPU cores (speedup {s['speedup']:.2f}x)",
            ["sync (staleness 0)", "async (staleness 1)"],
            [s["sync_steps_per_s"], s["async_steps_per_s"]],
            "steps / s",
        )
    # the side-by-side benchmarks draw their own figures (each module's ``plot``)
    import smollm2_learning
    import step_overhead
    import time_to_accuracy
    import vs_trl

    for module, name in (
        (vs_trl, "vs_trl"),
        (vs_trl, "vs_trl_natural"),
        (vs_trl, "vs_trl_smollm2"),
        (vs_trl, "vs_trl_smollm2_natural"),
        (smollm2_learning, "smollm2_learning"),
        (time_to_accuracy, "time_to_accuracy"),
        (step_overhead, "step_overhead"),
    ):
        path = RESULTS / f"{name}.json"
        if path.is_file():
            module.plot(json.loads(path.read_text()), RESULTS / f"{name}.png")
    path = RESULTS / "flow_grpo_throughput.json"
    if path.is_file():
        s = json.loads(path.read_text())
        bars(
            RESULTS / "flow_grpo_throughput.png",
            f"Flow-GRPO images/s (speedup {s['speedup']:.2f}x)",
            ["sync", "async"],
            [s["sync_images_per_s"], s["async_images_per_s"]],
            "images / s",
        )


if __name__ == "__main__":
    main()
