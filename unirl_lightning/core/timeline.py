"""A timeline of the pipeline: spans recorded as a run goes, written as a Chrome trace.

Standard library only (the rollout loop and the workers' call handles record into it; matplotlib is
imported by :func:`gantt` alone).

What is recorded (by whom)
    Per training rank, a ``trainer`` track: ``wait`` (the trainer blocked on generation: waiting on
    the oldest job, or a result transfer longer than 1 ms; the rollout loop), ``train_step`` (the
    module's ``training_step``), ``sync/quiesce`` and ``sync/push`` (the runtime's ``sync_weights``).
    Per rollout worker of that rank, a ``worker i`` track: ``generate`` spans (args: ``gen_id``,
    ``weight_version`` (the launch stamp), ``samples``, ``completion_tokens``; under
    ``sync_mode="interrupt"`` one span per chunk, with its ``chunk`` index, and a chunk a sync cut
    short is named ``generate (interrupted)``: the samples it leaves unfinished resume after the
    push), and the worker's restarts as instant events (``worker_restart``).

Clock rule
    Every time is ``time.time()`` seconds. A worker stamps its ``generate`` start and end with its
    own clock; the driver maps them onto its clock by clamping into the interval it observed itself,
    ``[launched, reaped]`` (the remote call was made at ``launched``, its result seen at ``reaped``):
    :func:`clamp_span`. On one machine the clocks agree and clamping changes nothing; across machines
    a skewed clock can never place a span outside what the driver saw.

Bounded
    A ring buffer of the last ``max_events`` events (default 20,000): the oldest are dropped first
    and counted in :attr:`Timeline.dropped` (written into the trace's ``otherData``).

Trace format (Chrome's ``chrome://tracing`` / Perfetto)
    ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``; spans are complete
    events ``{"name", "cat", "ph": "X", "ts", "dur", "pid", "tid", "args"}`` with ``ts``/``dur`` in
    microseconds, instants ``{"ph": "i", "s": "t", ...}``; ``pid`` is the training rank, ``tid`` 0 its
    trainer and ``1 + i`` its worker ``i`` (named by ``"ph": "M"`` metadata events).

Example::

    timeline = Timeline(rank=0)
    with timeline.measure("train_step", cat="train", step=3):
        ...
    timeline.write("runs/grpo/version_0/timeline.json")
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["Timeline", "clamp_span", "gantt", "read_trace", "spans_of"]

DEFAULT_MAX_EVENTS = 20_000


def clamp_span(start: float, end: float, launched: float, reaped: float) -> tuple[float, float]:
    """A worker's ``[start, end]`` on the driver's clock: clamped into ``[launched, reaped]``, the
    interval the driver observed (see the module docstring).

    >>> clamp_span(5.0, 12.0, 6.0, 10.0)
    (6.0, 10.0)
    """
    reaped = max(reaped, launched)
    start = min(max(start, launched), reaped)
    return start, min(max(end, start), reaped)


class Timeline:
    """The span recorder of one training rank (``pid`` = ``rank``); thread-safe, bounded.

    Args:
        rank: the training rank whose tracks these are.
        max_events: the ring buffer's size (the last ``max_events`` events are kept).
    """

    def __init__(self, rank: int = 0, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        self.rank = rank
        self.max_events = max_events
        self._events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._lock = threading.Lock()
        self._workers: set[int] = set()
        self.recorded = 0

    @property
    def dropped(self) -> int:
        """Events dropped from the ring buffer so far (the oldest first)."""
        return self.recorded - len(self._events)

    def _add(self, event: dict[str, Any], worker: int | None) -> None:
        with self._lock:
            if worker is not None:
                self._workers.add(worker)
            self._events.append(event)
            self.recorded += 1

    def span(
        self, name: str, start: float, end: float, *, cat: str = "", worker: int | None = None, **args: Any
    ) -> None:
        """A complete span from ``start`` to ``end`` (``time.time()`` seconds) on the trainer's track,
        or on worker ``worker``'s."""
        event = {
            "name": name,
            "cat": cat,
            "ph": "X",
            "ts": round(start * 1e6, 1),
            "dur": round(max(0.0, end - start) * 1e6, 1),
            "pid": self.rank,
            "tid": 0 if worker is None else 1 + worker,
            "args": args,
        }
        self._add(event, worker)

    def instant(
        self, name: str, at: float | None = None, *, cat: str = "", worker: int | None = None, **args: Any
    ) -> None:
        """An instant event at ``at`` (default: now)."""
        at = time.time() if at is None else at
        event = {
            "name": name,
            "cat": cat,
            "ph": "i",
            "s": "t",
            "ts": round(at * 1e6, 1),
            "pid": self.rank,
            "tid": 0 if worker is None else 1 + worker,
            "args": args,
        }
        self._add(event, worker)

    @contextlib.contextmanager
    def measure(self, name: str, *, cat: str = "", worker: int | None = None, **args: Any) -> Iterator[None]:
        """Record the span of the ``with`` block (recorded even when the block raises)."""
        start = time.time()
        try:
            yield
        finally:
            self.span(name, start, time.time(), cat=cat, worker=worker, **args)

    def events(self) -> list[dict[str, Any]]:
        """The kept events, oldest first, after one metadata event per track."""
        with self._lock:
            events, workers = list(self._events), sorted(self._workers)
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        meta.append(
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": "trainer"}}
        )
        for w in workers:
            meta.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": self.rank,
                    "tid": 1 + w,
                    "args": {"name": f"worker {w}"},
                }
            )
        return meta + events

    def trace(self) -> dict[str, Any]:
        return {
            "traceEvents": self.events(),
            "displayTimeUnit": "ms",
            "otherData": {"rank": self.rank, "max_events": self.max_events, "dropped": self.dropped},
        }

    def write(self, path: str | Path) -> Path:
        """Write the trace to ``path`` atomically (a temporary file in the same folder, then renamed)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.trace(), f, separators=(",", ":"))
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path


def read_trace(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def spans_of(trace: dict[str, Any], name: str | None = None) -> list[dict[str, Any]]:
    """The complete events (``ph: "X"``) of ``trace``, those named ``name`` only when given."""
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and (name is None or e["name"] == name)]


COLORS = {
    "generate": "#2f80ed",
    "generate (interrupted)": "#56ccf2",
    "wait": "#eb5757",
    "train_step": "#27ae60",
    "sync/quiesce": "#f2994a",
    "sync/push": "#9b51e0",
    "eval": "#828282",
}


def gantt(trace: dict[str, Any], path: str | Path, title: str = "pipeline timeline") -> Path:
    """Draw ``trace`` (a :meth:`Timeline.trace`, or several ranks' events together) as a PNG Gantt
    chart at ``path``: one row per track, time in seconds from the first event."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = trace["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    timed = [e for e in events if e.get("ph") in ("X", "i")]
    tracks = sorted({(e["pid"], e["tid"]) for e in timed})
    rows = {track: i for i, track in enumerate(tracks)}
    origin = min((e["ts"] for e in timed), default=0.0)
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.6 * max(1, len(tracks))))
    for e in timed:
        y = rows[(e["pid"], e["tid"])]
        x = (e["ts"] - origin) / 1e6
        if e["ph"] == "X":
            color = COLORS.get(e["name"], "#bdbdbd")
            ax.broken_barh([(x, e["dur"] / 1e6)], (y - 0.35, 0.7), facecolors=color, edgecolor="none")
        else:
            ax.plot([x], [y], marker="v", color="black", markersize=8)
    labels = [f"rank {pid} / {names.get((pid, tid), tid)}" for pid, tid in tracks]
    ax.set_yticks(range(len(tracks)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(
        handles=[Patch(color=c, label=n) for n, c in COLORS.items()],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
