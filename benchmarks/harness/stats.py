"""Statistics and the machine a figure came from: median and range over runs, the load at the time."""

from __future__ import annotations

import os
import platform
from typing import Any


def spread(values: list[float]) -> dict[str, float | None]:
    """Median, min and max (None entries, e.g. a target never reached, sort last)."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "n": len(values)}
    ordered = sorted(values, key=lambda v: float("inf") if v is None else v)
    median = ordered[(len(ordered) - 1) // 2] if len(ordered) % 2 else None
    if len(ordered) % 2 == 0:
        lo, hi = ordered[len(ordered) // 2 - 1], ordered[len(ordered) // 2]
        median = None if lo is None or hi is None else (lo + hi) / 2
    return {"median": median, "min": min(present), "max": ordered[-1], "n": len(values)}


def machine() -> dict[str, Any]:
    """The cores, Python and the 1-minute load average now (the envelope has the rest)."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
