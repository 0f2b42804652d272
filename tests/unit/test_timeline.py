"""The timeline recorder: the Chrome-trace format, the clock rule, the ring buffer, atomic writes,
the worker stamps a generation call carries back, and the Gantt chart."""

from __future__ import annotations

import json

from unirl_lightning.core.timeline import Timeline, clamp_span, gantt, read_trace, spans_of
from unirl_lightning.rollout.records import GenerationResult
from unirl_lightning.workers.calls import CallPart, merge_results


def test_spans_and_instants_are_chrome_trace_events():
    timeline = Timeline(rank=1)
    timeline.span("generate", 10.0, 10.5, cat="rollout", worker=0, gen_id=3)
    timeline.instant("worker_restart", 11.0, cat="fault", worker=0)
    with timeline.measure("train_step", cat="train"):
        pass
    trace = timeline.trace()
    events = trace["traceEvents"]
    generate = spans_of(trace, "generate")[0]
    assert generate == {
        "name": "generate",
        "cat": "rollout",
        "ph": "X",
        "ts": 10_000_000.0,
        "dur": 500_000.0,
        "pid": 1,
        "tid": 1,
        "args": {"gen_id": 3},
    }
    instant = next(e for e in events if e["ph"] == "i")
    assert instant["name"] == "worker_restart" and instant["ts"] == 11_000_000.0 and instant["tid"] == 1
    names = {(e["tid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert names == {(0, "trainer"), (1, "worker 0")}
    assert spans_of(trace, "train_step")[0]["tid"] == 0


def test_the_ring_buffer_keeps_the_last_events_and_counts_the_dropped():
    timeline = Timeline(max_events=5)
    for i in range(12):
        timeline.span("wait", i, i + 0.5)
    spans = spans_of(timeline.trace())
    assert [s["ts"] for s in spans] == [i * 1e6 for i in range(7, 12)]
    assert timeline.dropped == 7 and timeline.trace()["otherData"]["dropped"] == 7


def test_write_is_atomic_and_parses(tmp_path):
    timeline = Timeline()
    timeline.span("sync/push", 1.0, 2.0, cat="sync", version=1)
    path = timeline.write(tmp_path / "run" / "timeline.json")
    assert read_trace(path) == json.loads(json.dumps(timeline.trace()))
    assert [p.name for p in path.parent.iterdir()] == ["timeline.json"]  # no temporary left


def test_clamp_span_maps_worker_stamps_into_the_driver_observed_interval():
    assert clamp_span(2.0, 3.0, 1.0, 4.0) == (2.0, 3.0)  # agreeing clocks: unchanged
    assert clamp_span(0.0, 9.0, 1.0, 4.0) == (1.0, 4.0)  # a skewed clock: clamped
    assert clamp_span(7.0, 8.0, 1.0, 4.0) == (4.0, 4.0)
    start, end = clamp_span(3.5, 2.0, 1.0, 4.0)
    assert 1.0 <= start <= end <= 4.0


def test_a_generation_result_carries_each_parts_span_on_the_driver_clock():
    from unirl_lightning.rollout.records import Rollout, RolloutRequest

    rollout = Rollout([1, 2], [3, 4, 5], [0.0, 0.0, 0.0], 1.0, "stop")
    parts = [
        CallPart(
            0, RolloutRequest(records=[{}], n=1), None, None, 0.0, True, launched_at=100.0, reaped_at=101.0
        ),
        CallPart(
            1, RolloutRequest(records=[{}], n=1), None, None, 0.0, True, launched_at=100.0, reaped_at=102.0
        ),
    ]
    results = [
        GenerationResult([[rollout]], generate_s=0.5, score_s=0.1, span={"start": 100.2, "end": 100.9}),
        GenerationResult(
            [[rollout, rollout]], generate_s=0.5, score_s=0.1, span={"start": 99.0, "end": 103.0}
        ),
    ]
    spans = merge_results(results, parts).spans
    assert spans[0] == {"worker": 0, "start": 100.2, "end": 100.9, "samples": 1, "completion_tokens": 3}
    assert spans[1] == {"worker": 1, "start": 100.0, "end": 102.0, "samples": 2, "completion_tokens": 6}


def test_gantt_draws_a_png(tmp_path):
    timeline = Timeline()
    timeline.span("generate", 0.0, 1.0, worker=0, gen_id=0)
    timeline.span("wait", 0.0, 1.0)
    timeline.span("train_step", 1.0, 1.5)
    timeline.instant("worker_restart", 0.5, worker=0)
    path = gantt(timeline.trace(), tmp_path / "timeline.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_recorder_is_standard_library_only():
    import subprocess
    import sys

    code = "import sys, unirl_lightning.core.timeline; print(sorted({'torch', 'ray', 'matplotlib'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
