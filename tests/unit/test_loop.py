"""RolloutLoop policy with the real controller and instantly-ready fake jobs (no Ray, no model)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unirl_lightning.rollout.controller import BatchRolloutController
from unirl_lightning.rollout.loop import PendingBatch, RolloutLoop
from unirl_lightning.rollout.types import Rollout, SamplingParams


class Ready:
    def __init__(self, value):
        self.value = value

    def ready(self):
        return True

    def wait(self):
        pass

    def result(self):
        return self.value


def fake_generate(request):
    groups = [
        [
            Rollout(
                prompt_ids=[1],
                completion_ids=[2],
                logprobs=[-0.5],
                reward=1.0,
                finish_reason="stop",
                prompt=r["prompt"],
            )
            for _ in range(request.n)
        ]
        for r in request.records
    ]
    return Ready({"groups": groups, "generate_s": 0.01})


def make_loop(
    prompts, max_staleness=0, max_inflight=1, sync_interval=1, launched=None, generate=fake_generate
):
    def launch(request):
        if launched is not None:
            launched.append((request.gen_id, ctl.weight_version))
        return generate(request)

    holder = {}
    ctl = BatchRolloutController(launch, complete=lambda g, v, res: holder["loop"].complete(g, v, res))
    loop = RolloutLoop(
        prompts,
        ctl,
        num_generations=2,
        sampling=SamplingParams(max_new_tokens=1),
        max_staleness=max_staleness,
        max_inflight=max_inflight,
        sync_interval=sync_interval,
        pad_token_id=0,
    )
    holder["loop"] = loop
    return loop, ctl


def batches(n, size=2):
    return [[{"prompt": f"p{i}-{j}", "answer": "x"} for j in range(size)] for i in range(n)]


def test_iteration_yields_placeholders_and_the_step_runs_on_resolve():
    loop, ctl = make_loop(batches(3))
    pending = next(iter(loop))
    assert isinstance(pending, PendingBatch)
    assert ctl.next_gen_id == 0, "nothing may launch before the batch is resolved"
    batch = pending.resolve()
    assert batch.gen_ids.tolist() == [0, 0, 0, 0] and loop.steps == 1


def test_max_staleness_0_launches_one_request_per_step_under_the_current_version():
    launched = []
    loop, ctl = make_loop(batches(6), launched=launched)
    for step in range(5):
        batch = loop.next_batch()
        assert set(batch.gen_ids.tolist()) == {step}
        assert set(batch.weight_versions.tolist()) == {ctl.weight_version}
        ctl.sync_weights(lambda version: None)
    assert launched == [(g, g) for g in range(5)]


def test_async_window_launches_ahead_but_never_past_the_ceiling():
    launched = []
    loop, ctl = make_loop(batches(10), max_staleness=1, max_inflight=2, launched=launched)
    for _ in range(4):
        batch = loop.next_batch()
        assert max(ctl.weight_version - batch.weight_versions) <= 1
        ctl.quiesce()
        ctl.sync_weights(lambda version: None)
    for gen_id, version in launched:
        assert gen_id < (version + 2), f"gen_id {gen_id} launched under version {version} crosses the ceiling"


def test_when_generation_outpaces_training_the_freshest_is_trained_and_aged_groups_are_counted():
    # instantly-ready jobs: each step finds an older and a fresher request buffered; freshest-first
    # trains the fresher one, the older one ages past the budget and is evicted, counted, never trained
    loop, ctl = make_loop(batches(10), max_staleness=1, max_inflight=2)
    trained = []
    for _ in range(4):
        trained += sorted(set(loop.next_batch().gen_ids.tolist()))
        ctl.quiesce()
        ctl.sync_weights(lambda version: None)
    assert trained == [0, 2, 3, 4]
    assert loop.evicted_gen_ids == [1, 1] and loop.evicted_groups == 2  # one entry per evicted group
    launched = set(range(ctl.next_gen_id))
    assert launched == set(trained) | set(loop.evicted_gen_ids) | set(loop.untrained)


def test_prompt_stream_restarts_when_exhausted_and_counts_epochs():
    loop, ctl = make_loop(batches(2))
    prompts = [loop.next_batch() and None for _ in range(5)]
    assert len(prompts) == 5 and loop.prompt_epoch == 2


def test_state_dict_replays_launched_but_untrained_prompts_first():
    loop, ctl = make_loop(batches(8), max_staleness=1, max_inflight=2)
    loop.next_batch()  # trains batch 0, batch 1 is launched and buffered
    state = loop.state_dict()
    assert [r["prompt"] for r in state["untrained"][0]] == ["p1-0", "p1-1"]
    resumed, _ = make_loop(batches(8), max_staleness=1, max_inflight=2)
    resumed.load_state_dict(state)
    first = resumed._next_records()
    second = resumed._next_records()
    assert [r["prompt"] for r in first] == ["p1-0", "p1-1"]
    assert [r["prompt"] for r in second] == ["p2-0", "p2-1"], (
        "the stream resumes after the last prompt handed out"
    )


def test_bad_order_is_refused_naming_the_allowed_values():
    ctl = BatchRolloutController(fake_generate)
    with pytest.raises(ValueError, match="order must be one of .*'launch_first'.*got 'sideways'"):
        RolloutLoop(
            [],
            ctl,
            num_generations=1,
            sampling=SamplingParams(),
            max_staleness=0,
            max_inflight=1,
            sync_interval=1,
            pad_token_id=0,
            order="sideways",
        )


class Slow:
    """Ready only after ``delay`` polls (or a wait): generation that takes a while."""

    def __init__(self, value, delay):
        self.value, self.delay = value, delay

    def ready(self):
        self.delay -= 1
        return self.delay < 0

    def wait(self):
        self.delay = -1

    def result(self):
        return self.value


@settings(max_examples=60, deadline=None)
@given(
    max_staleness=st.integers(0, 2),
    max_inflight=st.integers(1, 4),
    sync_interval=st.integers(1, 3),
    delays=st.lists(st.integers(0, 3), min_size=12, max_size=12),
)
def test_any_cadence_trains_within_the_budget_and_never_starves(
    max_staleness, max_inflight, sync_interval, delays
):
    def slow_generate(request):
        return Slow(fake_generate(request).value, delays[request.gen_id % len(delays)])

    loop, ctl = make_loop(batches(4) * 10, max_staleness, max_inflight, sync_interval, generate=slow_generate)
    trained = []
    for step in range(10):
        batch = loop.next_batch()  # never raises: the launch ceiling always leaves something to train
        assert int((ctl.weight_version - batch.weight_versions).max()) <= max_staleness
        trained += sorted(set(batch.gen_ids.tolist()))
        if (step + 1) % sync_interval == 0:  # WeightSyncCallback's cadence
            ctl.quiesce()
            ctl.sync_weights(lambda version: None)
    assert len(trained) == len(set(trained))
    assert set(range(ctl.next_gen_id)) == set(trained) | set(loop.evicted_gen_ids) | set(loop.untrained)
