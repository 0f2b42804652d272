"""RolloutLoop policy with the real controller and instantly-ready fake jobs (no Ray, no model)."""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fakes import FakeGenerationHandle
from unirl_lightning.rollout.batches import ExperienceBatch
from unirl_lightning.rollout.controller import BatchRolloutController
from unirl_lightning.rollout.loop import DeferredBatch, RolloutLoop
from unirl_lightning.rollout.records import GenerationResult, Rollout, RolloutRequest, SamplingParams


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
    return FakeGenerationHandle(GenerationResult(groups, generate_s=0.01), ready=True)


def build_request(records, gen_id):
    return RolloutRequest(records=records, n=2, sampling=SamplingParams(max_new_tokens=1), gen_id=gen_id)


def make_loop(
    prompts,
    max_staleness=0,
    max_inflight=1,
    sync_interval=1,
    launched=None,
    generate=fake_generate,
    start_gen_id=0,
):
    def launch(request):
        if launched is not None:
            launched.append((request.gen_id, ctl.weight_version))
        return generate(request)

    ctl = BatchRolloutController(launch, start_gen_id=start_gen_id)
    loop = RolloutLoop(
        prompts,
        ctl,
        collate=functools.partial(ExperienceBatch.collate, pad_token_id=0),
        build_request=build_request,
        max_staleness=max_staleness,
        max_inflight=max_inflight,
        sync_interval=sync_interval,
    )
    return loop, ctl


def batches(n, size=2):
    return [[{"prompt": f"p{i}-{j}", "answer": "x"} for j in range(size)] for i in range(n)]


def test_iteration_yields_placeholders_and_the_step_runs_on_resolve():
    loop, ctl = make_loop(batches(3))
    pending = next(iter(loop))
    assert isinstance(pending, DeferredBatch)
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
    assert list(loop.recent_evicted_gen_ids) == [1, 1] and loop.evicted_groups == 2  # one per evicted group
    launched = set(range(ctl.next_gen_id))
    assert launched == set(trained) | set(loop.recent_evicted_gen_ids) | set(loop.untrained)


def test_prompt_stream_restarts_when_exhausted_and_counts_epochs():
    loop, ctl = make_loop(batches(2))
    prompts = [loop.next_batch() and None for _ in range(5)]
    assert len(prompts) == 5 and loop.stream.epoch == 2


def test_state_dict_replays_launched_but_untrained_prompts_first():
    loop, ctl = make_loop(batches(8), max_staleness=1, max_inflight=2)
    loop.next_batch()  # trains batch 0, batch 1 is launched and buffered
    state = loop.loop_state()
    assert [r["prompt"] for r in state["untrained"][0]] == ["p1-0", "p1-1"]
    resumed, _ = make_loop(batches(8), max_staleness=1, max_inflight=2)
    resumed.load_loop_state(state)
    first = resumed.stream.next_records()
    second = resumed.stream.next_records()
    assert [r["prompt"] for r in first] == ["p1-0", "p1-1"]
    assert [r["prompt"] for r in second] == ["p2-0", "p2-1"], (
        "the stream resumes after the last prompt handed out"
    )


def test_a_resumed_loop_keeps_as_many_requests_in_flight_as_before_the_restart():
    # slow jobs (ready after one poll) so that requests stay in flight across steps
    def slow_generate(request):
        return FakeGenerationHandle(fake_generate(request).value, delay=1)

    loop, ctl = make_loop(batches(20), max_staleness=1, max_inflight=2, generate=slow_generate)
    for _ in range(3):
        loop.next_batch()
        ctl.quiesce()
        ctl.sync_weights(lambda version: None)
    look_ahead = ctl.next_gen_id - loop.steps  # requests launched beyond the ones trained, at the "kill"
    state = loop.loop_state()
    resumed, ctl2 = make_loop(
        batches(20),
        max_staleness=1,
        max_inflight=2,
        generate=slow_generate,
        start_gen_id=state["next_gen_id"],
    )
    resumed.load_loop_state(state)
    resumed.next_batch()
    assert look_ahead == 1 and resumed.gen_id_offset == 1  # one relaunch
    # the relaunch (gen 4) and one step of look-ahead (gen 5), as before the restart
    assert ctl2.next_gen_id - resumed.steps - resumed.gen_id_offset == look_ahead
    assert resumed.loop_state()["gen_id_offset"] == 1


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
        return FakeGenerationHandle(fake_generate(request).value, delay=delays[request.gen_id % len(delays)])

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
    assert set(range(ctl.next_gen_id)) == set(trained) | set(loop.recent_evicted_gen_ids) | set(
        loop.untrained
    )
