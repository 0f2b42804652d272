"""CPU time per process: every process's title and CPU seconds at an instant, and the cores each kind
of process (the run's own, its rollout worker, Ray's others) used between two instants. ``psutil`` is
imported inside :func:`snapshot`."""

from __future__ import annotations

import time
from typing import Any

GENERATE_TITLE = "RolloutWorker.generate"  # Ray's process title while a worker's generate call runs


def snapshot() -> dict[str, Any]:
    """``{"t": time, "rows": {pid: (title, CPU seconds user + system)}}`` of every process now."""
    import psutil

    rows = {}
    for proc in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
        times = proc.info["cpu_times"]
        if times is None:
            continue
        title = " ".join(proc.info["cmdline"] or []) or proc.info["name"] or "?"
        rows[proc.info["pid"]] = (title.strip(), times.user + times.system)
    return {"t": time.time(), "rows": rows}


def label(title: str, me: int, pid: int, trainer_marker: str = "--child") -> str:
    """The kind of process of this title: ``me`` is the sampling process; a title holding
    ``trainer_marker`` is the run's own (training) process."""
    if pid == me:
        return "this sampler"
    if GENERATE_TITLE in title or title.startswith("ray::RolloutWorker"):
        return "rollout worker"
    if trainer_marker in title:
        return "trainer"
    if title.startswith("ray::") or "/ray/" in title or "raylet" in title or "gcs_server" in title:
        return "ray (other)"
    return "other"


def cpu_share(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], seconds: float, me: int = -1
) -> dict[str, float]:
    """The cores each kind of process used between two snapshots' ``rows`` (CPU seconds / wall
    seconds; 2.0 is both cores of a 2-core machine), by :func:`label`."""
    used: dict[str, float] = {}
    for pid, (title, cpu) in after.items():
        kind = label(title, me, pid)
        used[kind] = used.get(kind, 0.0) + cpu - before.get(pid, (title, 0.0))[1]
    return {kind: round(value / seconds, 3) for kind, value in sorted(used.items())}
