"""filter_groups (DAPO dynamic sampling) in the RolloutLoop: zero-variance groups are never trained,
every batch is full, replacements stay within the staleness bound and the per-step budget."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fakes import FakeGenerationHandle
from tests.unit.test_loop import batches, make_loop
from unirl_lightning.rollout.loop import zero_variance
from unirl_lightning.rollout.records import GenerationResult, Rollout


def rollout(prompt, reward):
    return Rollout(
        prompt_ids=[1],
        completion_ids=[2],
        logprobs=[-0.5],
        reward=reward,
        finish_reason="stop",
        prompt=prompt,
    )


def varying_engine(is_flat, delays=None, produced=None):
    """A fake engine: group ``j`` of request ``g`` has equal rewards when ``is_flat(g, j)``.
    ``produced[g]`` records how many flat groups request ``g`` made."""

    def generate(request):
        groups = []
        for j, record in enumerate(request.records):
            flat = is_flat(request.gen_id, j)
            rewards = [1.0] * request.n if flat else [float(k % 2) for k in range(request.n)]
            groups.append([rollout(record["prompt"], r) for r in rewards])
        if produced is not None:
            produced[request.gen_id] = sum(zero_variance(g) for g in groups)
        value = GenerationResult(groups, generate_s=0.01)
        delay = None if delays is None else delays[request.gen_id % len(delays)]
        return FakeGenerationHandle(value, ready=delays is None, delay=delay)

    return generate


def filtering_loop(prompts, generate, budget=10, **kwargs):
    loop, ctl = make_loop(prompts, generate=generate, **kwargs)
    loop.filter_groups = True
    loop.max_filter_launches_per_step = budget
    return loop, ctl


def trained_groups(batch):
    """The rewards of each group of ``batch`` (rows are group-contiguous)."""
    rewards = batch.rewards.tolist()
    size = batch.group_size
    return [rewards[i : i + size] for i in range(0, len(rewards), size)]


def test_staleness_0_replaces_every_dropped_group_under_the_current_version():
    # every other request is all zero-variance; the others are half zero-variance
    produced = {}
    launched = []
    loop, ctl = filtering_loop(
        batches(40, size=4),
        varying_engine(lambda g, j: g % 2 == 1 or j % 2 == 0, produced=produced),
        launched=launched,
    )
    for _ in range(6):
        batch = loop.next_batch()
        groups = trained_groups(batch)
        assert len(groups) == 4, "every batch has groups_per_step groups"
        assert all(len(set(g)) > 1 for g in groups), "a zero-variance group was trained"
        assert set(batch.weight_versions.tolist()) == {ctl.weight_version}
        assert batch.stats["rollout/zero_variance_groups"] == 0.0
        assert batch.stats["rollout/filtered_groups"] == loop.filtered_groups
        ctl.sync_weights(lambda version: None)
    # requests (replacements included) are launched only within a step, under that step's version
    assert [version for _, version in launched] == sorted(version for _, version in launched)
    ctl.quiesce()
    assert loop.filtered_groups == sum(produced.values())
    assert loop.filtered_groups > 0 and loop.gen_id_offset == ctl.next_gen_id - loop.steps


def test_staleness_0_never_launches_past_the_step_without_a_shortfall():
    # no zero-variance group: the loop is exactly the unfiltered one (one request per step)
    launched = []
    loop, ctl = filtering_loop(batches(6), varying_engine(lambda g, j: False), launched=launched)
    for _ in range(5):
        loop.next_batch()
        ctl.sync_weights(lambda version: None)
    assert launched == [(g, g) for g in range(5)] and loop.filtered_groups == 0
    assert loop.gen_id_offset == 0


def test_staleness_1_keeps_the_bound_and_fills_every_batch():
    produced = {}
    loop, ctl = filtering_loop(
        batches(60, size=3),
        varying_engine(lambda g, j: (g * 3 + j) % 4 != 0, produced=produced),
        max_staleness=1,
        max_inflight=2,
    )
    for _ in range(8):
        batch = loop.next_batch()
        groups = trained_groups(batch)
        assert len(groups) == 3 and all(len(set(g)) > 1 for g in groups)
        assert int((ctl.weight_version - batch.weight_versions).max()) <= 1
        ctl.quiesce()
        ctl.sync_weights(lambda version: None)
    ctl.quiesce()
    assert loop.filtered_groups == sum(produced.values()) > 0


def test_the_budget_bounds_replacements_and_a_step_past_it_raises():
    launched = []
    loop, ctl = filtering_loop(batches(20), varying_engine(lambda g, j: True), budget=3, launched=launched)
    with pytest.raises(RuntimeError, match="max_filter_launches_per_step=3"):
        loop.next_batch()
    assert len(launched) == 1 + 3, "the ceiling's request and exactly the budget's replacements"
    assert loop.steps == 0 and loop.filtered_groups == 4 * 2


def test_a_step_that_fills_within_the_budget_trains():
    # the first three requests are all zero-variance: the budget of 3 is just enough
    loop, ctl = filtering_loop(batches(20), varying_engine(lambda g, j: g < 3), budget=3)
    batch = loop.next_batch()
    assert sorted(set(batch.gen_ids.tolist())) == [3]
    assert batch.stats["rollout/filter_launches"] == 3.0 and batch.stats["rollout/filtered_groups"] == 6.0
    assert list(loop.recent_filtered_gen_ids) == [0, 1, 2] and not set(loop.untrained) & {0, 1, 2}
    ctl.sync_weights(lambda version: None)
    assert loop.next_batch().stats["rollout/filter_launches"] == 0.0, "the budget is per step"


def test_the_filtered_count_and_the_replacements_survive_a_checkpoint():
    loop, ctl = filtering_loop(batches(20), varying_engine(lambda g, j: g == 0))
    loop.next_batch()
    state = loop.loop_state()
    assert state["filtered_groups"] == 2 and state["gen_id_offset"] == 1
    resumed, _ = filtering_loop(
        batches(20), varying_engine(lambda g, j: False), start_gen_id=state["next_gen_id"]
    )
    resumed.load_loop_state(state)
    assert resumed.filtered_groups == 2 and resumed.launch_limit() == loop.launch_limit()


@settings(max_examples=60, deadline=None)
@given(
    max_staleness=st.integers(0, 2),
    max_inflight=st.integers(1, 4),
    sync_interval=st.integers(1, 3),
    order=st.sampled_from(["launch_first", "poll_first"]),
    delays=st.lists(st.integers(0, 3), min_size=12, max_size=12),
    flat=st.lists(st.booleans(), min_size=13, max_size=13),
)
def test_any_cadence_trains_only_varied_groups_full_batches_within_the_bound(
    max_staleness, max_inflight, sync_interval, order, delays, flat
):
    produced = {}
    loop, ctl = filtering_loop(
        batches(4, size=3) * 30,
        varying_engine(lambda g, j: flat[(g * 3 + j) % len(flat)], delays=delays, produced=produced),
        budget=50,
        max_staleness=max_staleness,
        max_inflight=max_inflight,
        sync_interval=sync_interval,
    )
    loop.order = order
    trained = []
    for step in range(8):
        try:
            batch = loop.next_batch()
        except RuntimeError:  # possible only when every group is flat: nothing can ever fill a batch
            assert all(flat)
            return
        groups = trained_groups(batch)
        assert len(groups) == 3 and all(len(set(g)) > 1 for g in groups)
        assert int((ctl.weight_version - batch.weight_versions).max()) <= max_staleness
        assert batch.stats["rollout/filter_launches"] <= 50
        trained += sorted(set(batch.gen_ids.tolist()))
        if (step + 1) % sync_interval == 0:
            ctl.quiesce()
            ctl.sync_weights(lambda version: None)
    ctl.quiesce()
    assert loop.filtered_groups == sum(produced.values())
    accounted = set(trained) | set(loop.recent_evicted_gen_ids) | set(loop.untrained)
    assert set(range(ctl.next_gen_id)) == accounted | set(loop.recent_filtered_gen_ids)


# -- the module option -------------------------------------------------------------------------
def test_grpo_carries_filter_groups_to_the_rollout_spec():
    from tests.builders import tiny_module

    spec = tiny_module(filter_groups=True, max_filter_launches_per_step=4).rollout_spec()
    assert spec.filter_groups is True and spec.max_filter_launches_per_step == 4
    assert tiny_module().rollout_spec().filter_groups is False
    with pytest.raises(ValueError, match="max_filter_launches_per_step must be >= 1, got 0"):
        tiny_module(filter_groups=True, max_filter_launches_per_step=0)


def test_agentic_grpo_refuses_filter_groups():
    from unirl_lightning.modules.agentic_grpo import AgenticGRPOModule

    with pytest.raises(ValueError, match="filter_groups is not supported by AgenticGRPOModule"):
        AgenticGRPOModule(env="unirl_lightning.envs:GuessingGameEnv", filter_groups=True)
