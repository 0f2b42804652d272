"""Engine occupancy: time-averaged active rows over slots, from the counters each engine reports with
its results (``span["occupancy"]``: ``row_seconds`` = active rows x seconds summed over its decode
steps, ``seconds`` = its age, ``slots``). Standard library only.

Over a window, a worker's occupancy is ``delta(row_seconds) / (slots * delta(seconds))``: idle time
counts as empty slots, and so does the tail of a static ``generate`` call whose finished rows wait
for its longest one. ``rollout/engine_occupancy`` is the ratio of the sums over every worker seen.

An engine that runs its own step loop (the continuous HF engine) also reports ``busy_seconds`` and
``steps``: the seconds and count of the steps that produced a token. From them,
``rollout/engine_busy`` is the share of the window the loops were stepping (the rest they had no work,
or waited on a weight push), and ``rollout/engine_step_ms`` the mean step time: occupancy says how
full a step was, these two how often steps ran and how long each took (a step slower than the
engine alone measures is contention for the cores or the device).

``starved_slot_seconds`` (every engine here reports it; the static HF engine counts only the time it
ran no call, since the free slots of a running call are its own tail) is the free slots x seconds
while the engine had no row queued: ``rollout/engine_starved`` is its share of the slot-time. Starved
slots are empty because the callers sent no work (the staleness window or ``max_inflight`` held
launches back, or the prompts ran out); ``1 - occupancy - starved`` is empty while rows were queued
(refills, weight pushes). A starved engine while the window's headroom is 0
(``rollout/window_headroom``) and the trainer waits is held back by ``max_staleness``
(docs/engines.md, "Reading the engine metrics").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["OccupancyMeter"]

_STEP_KEYS = ("busy_seconds", "steps")
_STARVED = "starved_slot_seconds"


class OccupancyMeter:
    """Accumulates the engines' occupancy between two :meth:`stats` calls.

    >>> meter = OccupancyMeter()
    >>> meter.observe_spans([{"worker": 0, "occupancy": {"row_seconds": 0.0, "seconds": 0.0, "slots": 4.0}}])
    >>> meter.observe_spans([{"worker": 0, "occupancy": {"row_seconds": 6.0, "seconds": 2.0, "slots": 4.0}}])
    >>> meter.stats()
    {'rollout/engine_occupancy': 0.75}
    >>> meter.observe_spans([{"worker": 0, "occupancy": {"row_seconds": 5.0, "seconds": 1.5, "slots": 4.0}}])
    >>> meter.stats()  # a report older than one already seen adds nothing
    {}
    """

    def __init__(self) -> None:
        self._last: dict[Any, dict[str, float]] = {}
        self._rows = 0.0
        self._capacity = 0.0
        self._wall = 0.0  # seconds of the windows whose reports carried step counters
        self._busy = 0.0
        self._steps = 0.0
        self._starved = 0.0
        self._starved_capacity = 0.0  # slot-seconds of the windows whose reports counted starved slots

    def observe_spans(self, spans: Iterable[dict[str, Any]]) -> None:
        """Take the counters of every span that carries them (a worker's first report only sets its
        starting point)."""
        for span in spans:
            counters = span.get("occupancy")
            if counters is None:
                continue
            now = {key: float(value) for key, value in counters.items()}
            before = self._last.get(span["worker"])
            if before is not None and now["row_seconds"] < before["row_seconds"]:
                before = None  # the counters went back: a replaced worker, counted from its first report
            elif before is not None and now["seconds"] <= before["seconds"]:
                continue  # an older report reaped after a newer one (concurrent calls): already counted
            if before is not None:
                seconds = now["seconds"] - before["seconds"]
                self._rows += now["row_seconds"] - before["row_seconds"]
                self._capacity += now["slots"] * seconds
                if all(key in now and key in before for key in _STEP_KEYS):
                    self._wall += seconds
                    self._busy += now["busy_seconds"] - before["busy_seconds"]
                    self._steps += now["steps"] - before["steps"]
                if _STARVED in now and _STARVED in before:
                    self._starved += now[_STARVED] - before[_STARVED]
                    self._starved_capacity += now["slots"] * seconds
            self._last[span["worker"]] = now

    def stats(self) -> dict[str, float]:
        """``{"rollout/engine_occupancy": ratio}`` over the window since the last call, with
        ``rollout/engine_busy`` and ``rollout/engine_step_ms`` where the engines count their steps and
        ``rollout/engine_starved`` where they count starved slots (``{}`` when no window was measured),
        then a new window."""
        if self._capacity <= 0:
            return {}
        out = {"rollout/engine_occupancy": self._rows / self._capacity}
        if self._wall > 0:
            out["rollout/engine_busy"] = self._busy / self._wall
        if self._steps > 0:
            out["rollout/engine_step_ms"] = 1e3 * self._busy / self._steps
        if self._starved_capacity > 0:
            out["rollout/engine_starved"] = self._starved / self._starved_capacity
        self._rows = self._capacity = self._wall = self._busy = self._steps = 0.0
        self._starved = self._starved_capacity = 0.0
        return out
