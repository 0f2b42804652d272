"""Draw the README's benchmark figures from benchmarks/results/*.json, or a run's timeline.

python -m benchmarks.harness.plot
python -m benchmarks.harness.plot --timeline runs/grpo_tiny/version_0/timeline.json   # -> timeline.png beside it

Each side-by-side benchmark's figure is drawn by its report module (``peers/vs_trl_report.py``,
``peers/time_to_accuracy_report.py`` and ``peers/smollm2_learning.py``'s ``plot``) from the JSON its last
run wrote; the two throughput benchmarks get a bar chart each. The figures go beside their JSON, in the
results folder (``--output DIR`` / ``$UNIRL_BENCH_RESULTS``, default ``benchmarks/results``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.harness import common, figures

# results file -> the module whose ``plot(results, path)`` draws it
FIGURES = {
    "vs_trl": "benchmarks.peers.vs_trl_report",
    "vs_trl_natural": "benchmarks.peers.vs_trl_report",
    "vs_trl_smollm2": "benchmarks.peers.vs_trl_report",
    "vs_trl_smollm2_natural": "benchmarks.peers.vs_trl_report",
    "smollm2_learning": "benchmarks.peers.smollm2_learning",
    "smollm2_learning_seeds": "benchmarks.peers.smollm2_learning",
    "smollm2_reasoning_gym": "benchmarks.peers.smollm2_learning",
    "time_to_accuracy": "benchmarks.peers.time_to_accuracy_report",
}


def timeline_gantt(trace_path: Path, out: Path | None = None) -> Path:
    """A run's ``timeline.json`` (Chrome trace) as a Gantt chart PNG (default: ``timeline.png`` beside it)."""
    from unirl_lightning.core.timeline import gantt, read_trace

    trace_path = Path(trace_path)
    out = gantt(
        read_trace(trace_path), out or trace_path.with_suffix(".png"), f"timeline of {trace_path.parent.name}"
    )
    print(f"wrote {out}")
    return out


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Every figure whose results JSON exists (or, with ``config["timeline"]``, that run's Gantt
    chart); the figures written."""
    import importlib

    if config.get("timeline") is not None:
        return {"figures": [str(timeline_gantt(config["timeline"]))]}
    results, drawn = common.results_dir(), []
    path = results / "async_vs_sync.json"
    if path.is_file():
        s = json.loads(path.read_text())["summary"]
        figures.bars(
            results / "async_vs_sync.png",
            f"GRPO steps/s on 2 CPU cores (speedup {s['speedup']:.2f}x)",
            ["sync (staleness 0)", "async (staleness 1)"],
            [s["sync_steps_per_s"], s["async_steps_per_s"]],
            "steps / s",
        )
        drawn.append(path.with_suffix(".png"))
    for name, module in FIGURES.items():
        path = results / f"{name}.json"
        if path.is_file():
            importlib.import_module(module).plot(json.loads(path.read_text()), path.with_suffix(".png"))
            drawn.append(path.with_suffix(".png"))
    path = results / "flow_grpo_throughput.json"
    if path.is_file():
        s = json.loads(path.read_text())
        figures.bars(
            results / "flow_grpo_throughput.png",
            f"Flow-GRPO images/s (speedup {s['speedup']:.2f}x)",
            ["sync", "async"],
            [s["sync_images_per_s"], s["async_images_per_s"]],
            "images / s",
        )
        drawn.append(path.with_suffix(".png"))
    return {"figures": [str(p) for p in drawn]}


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument(
        "--timeline", type=Path, help="draw this run's timeline.json as a Gantt chart instead"
    )
    common.finish(run(common.parse_config(parser)), None)


if __name__ == "__main__":
    main()
