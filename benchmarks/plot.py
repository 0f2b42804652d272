"""Draw the README's benchmark figures from benchmarks/results/*.json.

python benchmarks/plot.py
"""

from __future__ import annotations

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


def main() -> None:
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
    import step_overhead
    import time_to_accuracy
    import vs_trl

    for module, name in (
        (vs_trl, "vs_trl"),
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
