"""The pipeline's timeline of a short tiny fit: ``timeline.json`` in the log folder parses, every
generation appears once, and no generation overlaps a weight push (the quiesce contract from outside)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.builders import fit_tiny
from unirl_lightning.core.timeline import gantt, read_trace, spans_of
from unirl_lightning.strategy import AsyncRolloutStrategy

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory, ray_local):
    strategy = AsyncRolloutStrategy(max_staleness=1, max_inflight=2, num_workers=1)
    trainer, module, recorder = fit_tiny(tmp_path_factory.mktemp("timeline"), max_steps=6, strategy=strategy)
    path = Path(trainer.log_dir) / "timeline.json"
    yield trainer, recorder, read_trace(path), path
    strategy.shutdown()


def test_the_trace_has_every_track_and_span_kind(traced_run):
    _, _, trace, _ = traced_run
    names = {e["name"] for e in spans_of(trace)}
    assert {"generate", "wait", "train_step", "sync/quiesce", "sync/push"} <= names
    assert len(spans_of(trace, "train_step")) == 6
    for span in spans_of(trace):
        assert span["dur"] >= 0 and span["pid"] == 0
    generate = spans_of(trace, "generate")
    assert {s["tid"] for s in generate} == {1}  # worker 0's track
    assert all(s["args"]["samples"] > 0 and s["args"]["completion_tokens"] > 0 for s in generate)


def test_every_gen_id_appears_once_and_every_trained_one_was_generated(traced_run):
    _, recorder, trace, _ = traced_run
    gen_ids = [s["args"]["gen_id"] for s in spans_of(trace, "generate")]
    assert len(gen_ids) == len(set(gen_ids))
    trained = {g for step in recorder.steps for g in step["gen_ids"]}
    assert trained <= set(gen_ids)


def test_no_generation_overlaps_a_weight_push(traced_run):
    _, _, trace, _ = traced_run
    pushes = spans_of(trace, "sync/push")
    assert pushes
    for gen in spans_of(trace, "generate"):
        for push in pushes:
            assert gen["ts"] + gen["dur"] <= push["ts"] or push["ts"] + push["dur"] <= gen["ts"], (gen, push)


def test_the_trace_draws_as_a_gantt_png(traced_run, tmp_path):
    _, _, trace, _ = traced_run
    assert gantt(trace, tmp_path / "timeline.png").stat().st_size > 0
