"""Figures: matplotlib without a display, one way to save them, and the bar chart of a speedup."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path) -> None:
    """Lay out, write (110 dpi) and close a matplotlib figure, saying where it went."""
    plt = pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def bars(path: str | Path, title: str, labels: list[str], values: list[float], unit: str) -> None:
    """One bar per label, each with its value written on it."""
    fig, ax = pyplot().subplots(figsize=(5, 3))
    drawn = ax.bar(labels, values, color=["#9aa5b1", "#2f80ed", "#27ae60"][: len(labels)])
    ax.bar_label(drawn, fmt="%.2f")
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)
