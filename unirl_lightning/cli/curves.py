"""Reading TensorBoard event files back and drawing their curves (the demo; the tests and the
benchmarks use it too)."""

from __future__ import annotations

from pathlib import Path


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag under ``log_dir`` as ``{tag: [(step, value), ...]}`` in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    files = sorted(Path(log_dir).rglob("events.out.tfevents.*"))
    if not files:
        raise FileNotFoundError(f"no TensorBoard event files under {log_dir}")
    for path in files:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "histograms": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return {tag: sorted(values) for tag, values in scalars.items()}


def plot_curves(
    scalars: dict[str, list[tuple[int, float]]], tags: list[str], path: str | Path, title: str
) -> Path:
    """Draw ``tags`` against the step into a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for tag in tags:
        if tag in scalars:
            steps, values = zip(*scalars[tag])
            ax.plot(steps, values, marker="o" if len(steps) < 20 else None, label=tag)
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
