"""Pins the contract of ``unirl_lightning.rollout.controller``: one test per invariant."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.fakes import FakeGenerationHandle
from unirl_lightning.rollout.controller import (
    BatchRolloutController,
    InflightPool,
    StampedGroup,
    VersionedBuffer,
    launch_ceiling,
)


class FakeLauncher:
    """``launch`` callable that records every pending it hands out, in launch order."""

    def __init__(self, ready: bool = False) -> None:
        self.ready = ready
        self.pendings: list[FakeGenerationHandle] = []

    def __call__(self, request: Any) -> FakeGenerationHandle:
        pending = FakeGenerationHandle(request, ready=self.ready)
        self.pendings.append(pending)
        return pending


def make_controller(ready: bool = False, **kwargs: Any) -> tuple[BatchRolloutController, FakeLauncher]:
    launcher = FakeLauncher(ready=ready)
    return BatchRolloutController(launcher, **kwargs), launcher


def groups_of(items: list[StampedGroup] | None) -> list[Any]:
    assert items is not None
    return [item.group for item in items]


# --- submit / launch_until -------------------------------------------------------------------------


def test_submit_hands_out_consecutive_gen_ids_from_start_gen_id():
    controller, _ = make_controller(start_gen_id=7)
    assert [controller.submit(f"r{index}") for index in range(4)] == [7, 8, 9, 10]
    assert controller.next_gen_id == 11
    assert controller.inflight == 4


def test_submit_stamps_the_weight_version_current_at_launch():
    controller, launcher = make_controller()
    controller.submit("before-sync")
    controller.quiesce()
    controller.sync_weights(lambda version: None)
    controller.submit("after-sync")  # launched under version 1
    controller.quiesce()
    drained = controller.drain_freshest(2)
    assert [(item.group, item.weight_version) for item in drained] == [("after-sync", 1), ("before-sync", 0)]


def test_version_stamp_is_the_launch_version_even_when_reaped_after_a_later_sync():
    controller, launcher = make_controller()
    controller.submit("launched-at-v0")
    launcher.pendings[0].failures_left = 1
    with pytest.raises(RuntimeError, match="generation failed"):
        controller.quiesce()
    # the stuck job blocks the sync, so the stamp can never be a later version than at launch
    with pytest.raises(RuntimeError, match="in flight"):
        controller.sync_weights(lambda version: None)
    controller.quiesce()
    assert controller.drain_freshest(1)[0].weight_version == 0


def test_failed_launch_uses_up_no_gen_id_and_tracks_nothing():
    def failing_launch(request):
        raise ConnectionError("worker gone")

    controller = BatchRolloutController(failing_launch, start_gen_id=3)
    with pytest.raises(ConnectionError):
        controller.submit("r")
    assert controller.next_gen_id == 3
    assert controller.inflight == 0


def test_launch_until_stops_at_the_gen_id_limit():
    controller, _ = make_controller()
    built: list[int] = []
    launched = controller.launch_until(
        3, max_inflight=10, build=lambda gen_id: built.append(gen_id) or gen_id
    )
    assert launched == 3
    assert built == [0, 1, 2]
    assert controller.launch_until(3, max_inflight=10, build=lambda gen_id: gen_id) == 0


def test_launch_until_stops_at_max_inflight_and_tops_up_after_a_reap():
    controller, launcher = make_controller()
    assert controller.launch_until(100, max_inflight=2, build=lambda gen_id: gen_id) == 2
    assert controller.inflight == 2
    launcher.pendings[0].is_ready = True
    controller.poll()
    assert controller.launch_until(100, max_inflight=2, build=lambda gen_id: gen_id) == 1
    assert controller.next_gen_id == 3


# --- poll: complete-or-nothing ---------------------------------------------------------------------


def test_poll_skips_unready_jobs():
    controller, launcher = make_controller()
    controller.submit("a")
    controller.submit("b")
    launcher.pendings[1].is_ready = True
    assert controller.poll() == 1
    assert launcher.pendings[0].result_calls == 0
    assert controller.inflight == 1
    assert groups_of(controller.drain_freshest(1)) == ["b"]


def test_poll_returns_the_number_of_groups_inserted_and_one_completion_may_yield_several_groups():
    controller, _ = make_controller(
        ready=True, complete=lambda gen_id, version, result: [result + "0", result + "1"]
    )
    controller.submit("a")
    controller.submit("b")
    assert controller.poll() == 4
    drained = controller.drain_freshest(4)
    assert [(item.gen_id, item.weight_version, item.group) for item in drained] == [
        (0, 0, "a0"),
        (0, 0, "a1"),
        (1, 0, "b0"),
        (1, 0, "b1"),
    ]


def test_complete_receives_gen_id_weight_version_and_the_result():
    seen: list[tuple[int, int, Any]] = []
    controller, _ = make_controller(
        ready=True, start_gen_id=5, start_weight_version=2, complete=lambda *args: seen.append(args) or []
    )
    controller.submit("payload")
    controller.poll()
    assert seen == [(5, 2, "payload")]


def test_failing_result_leaves_the_job_in_flight_and_a_retry_inserts_exactly_once():
    controller, launcher = make_controller(ready=True)
    controller.submit("a")
    launcher.pendings[0].failures_left = 1
    with pytest.raises(RuntimeError, match="generation failed"):
        controller.poll()
    assert controller.inflight == 1
    assert controller.buffered == 0
    assert controller.poll() == 1
    assert controller.poll() == 0
    assert controller.inflight == 0
    assert controller.buffered == 1


def test_failing_complete_leaves_the_job_in_flight_and_a_retry_inserts_exactly_once():
    failures = {"left": 1}

    def complete(gen_id, weight_version, result):
        if failures["left"]:
            failures["left"] -= 1
            raise ValueError("reward model timed out")
        return [result]

    controller, _ = make_controller(ready=True, complete=complete)
    controller.submit("a")
    with pytest.raises(ValueError, match="reward model timed out"):
        controller.poll()
    assert (controller.inflight, controller.buffered) == (1, 0)
    assert controller.poll() == 1
    assert (controller.inflight, controller.buffered) == (0, 1)


def test_complete_that_fails_halfway_through_its_groups_inserts_none_of_them():
    def complete(gen_id, weight_version, result):
        yield "first"
        raise ValueError("second group malformed")

    controller, _ = make_controller(ready=True, complete=complete)
    controller.submit("a")
    with pytest.raises(ValueError, match="malformed"):
        controller.poll()
    assert (controller.inflight, controller.buffered) == (1, 0)


def test_two_failing_jobs_are_both_attempted_the_first_error_is_raised_and_both_stay_in_flight(caplog):
    controller, launcher = make_controller(ready=True)
    for name in ("a", "b", "c"):
        controller.submit(name)
    launcher.pendings[0].failures_left = 1
    launcher.pendings[0].failure = RuntimeError("first failure")
    launcher.pendings[2].failures_left = 1
    launcher.pendings[2].failure = RuntimeError("second failure")
    with caplog.at_level(logging.ERROR, logger="unirl_lightning.rollout.controller"):
        with pytest.raises(RuntimeError, match="first failure"):
            controller.poll()
    assert [pending.result_calls for pending in launcher.pendings] == [1, 1, 1]
    assert controller.inflight == 2
    assert groups_of(controller.drain_freshest(1)) == ["b"]
    assert "gen_id=2" in caplog.text
    assert controller.poll() == 2
    assert controller.inflight == 0


def test_keyboard_interrupt_passes_straight_through_and_leaves_the_job_in_flight():
    controller, launcher = make_controller(ready=True)
    controller.submit("reaped-before-interrupt")
    controller.submit("interrupted")
    controller.submit("never-reached")
    launcher.pendings[1].failures_left = 1
    launcher.pendings[1].failure = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        controller.poll()
    assert launcher.pendings[2].result_calls == 0
    assert controller.inflight == 2
    assert controller.buffered == 1
    assert controller.poll() == 2
    assert groups_of(controller.drain_freshest(3)) == [
        "reaped-before-interrupt",
        "interrupted",
        "never-reached",
    ]


# --- wait_oldest / quiesce -------------------------------------------------------------------------


def test_wait_oldest_blocks_on_the_oldest_job_only_and_does_not_reap():
    controller, launcher = make_controller()
    controller.submit("a")
    controller.submit("b")
    controller.wait_oldest()
    assert [pending.wait_calls for pending in launcher.pendings] == [1, 0]
    assert controller.inflight == 2
    assert controller.poll() == 1


def test_wait_oldest_with_nothing_in_flight_returns_at_once():
    controller, _ = make_controller()
    assert controller.wait_oldest() is None


def test_quiesce_waits_and_reaps_in_gen_id_order_until_nothing_is_in_flight():
    order: list[int] = []
    controller, launcher = make_controller(
        complete=lambda gen_id, version, result: order.append(gen_id) or [result]
    )
    for name in ("a", "b", "c"):
        controller.submit(name)
    launcher.pendings[2].is_ready = True  # the youngest is ready first; quiesce still goes in gen_id order
    assert controller.quiesce() == 3
    assert order == [0, 1, 2]
    assert controller.inflight == 0
    assert [pending.wait_calls for pending in launcher.pendings] == [1, 1, 1]


def test_quiesce_leaves_failing_jobs_in_flight_and_raises_the_first_error():
    controller, launcher = make_controller()
    controller.submit("a")
    controller.submit("b")
    launcher.pendings[0].failures_left = 1
    with pytest.raises(RuntimeError, match="generation failed"):
        controller.quiesce()
    assert (controller.inflight, controller.buffered) == (1, 1)
    assert controller.quiesce() == 1
    assert controller.inflight == 0


# --- drain_freshest / pop_evicted ------------------------------------------------------------------


def fill(controller: BatchRolloutController, names_per_version: list[list[str]]) -> None:
    """Launch and reap ``names_per_version[v]`` under weight version ``v``, syncing in between."""
    for version, names in enumerate(names_per_version):
        if version:
            controller.sync_weights(lambda new_version: None)
        for name in names:
            controller.submit(name)
        controller.quiesce()


def test_drain_freshest_returns_highest_version_first_and_insertion_order_within_a_version():
    controller, _ = make_controller()
    fill(controller, [["v0-a", "v0-b"], ["v1-a", "v1-b", "v1-c"], ["v2-a"]])
    assert groups_of(controller.drain_freshest(4)) == ["v2-a", "v1-a", "v1-b", "v1-c"]
    assert groups_of(controller.drain_freshest(2)) == ["v0-a", "v0-b"]


def test_drain_freshest_removes_what_it_returns():
    controller, _ = make_controller(ready=True)
    controller.submit("a")
    controller.submit("b")
    controller.poll()
    assert groups_of(controller.drain_freshest(1)) == ["a"]
    assert controller.buffered == 1
    assert groups_of(controller.drain_freshest(1)) == ["b"]
    assert controller.buffered == 0


def test_drain_freshest_items_are_frozen_stamped_groups():
    controller, _ = make_controller(ready=True, start_gen_id=4)
    controller.submit("a")
    controller.poll()
    (item,) = controller.drain_freshest(1)
    assert item == StampedGroup(gen_id=4, weight_version=0, group="a")
    with pytest.raises(AttributeError):
        item.weight_version = 9  # type: ignore[misc]
    assert not hasattr(item, "__dict__")  # slotted


def test_drain_freshest_short_with_work_in_flight_returns_none_and_consumes_nothing():
    controller, launcher = make_controller()
    controller.submit("a")
    controller.submit("b")
    launcher.pendings[0].is_ready = True
    controller.poll()
    assert controller.drain_freshest(2) is None
    assert controller.buffered == 1
    assert controller.pop_evicted() == []


def test_drain_freshest_short_with_nothing_in_flight_raises_naming_n_and_the_buffered_count():
    controller, _ = make_controller(ready=True)
    controller.submit("a")
    controller.poll()
    with pytest.raises(RuntimeError, match=r"n=3.*only 1 group\(s\) are buffered.*nothing is in flight"):
        controller.drain_freshest(3)
    assert controller.buffered == 1


def test_drain_freshest_evicts_groups_over_the_staleness_budget_before_counting():
    controller, _ = make_controller()
    fill(controller, [["v0"], ["v1"], ["v2"], ["v3"]])
    # current version 3, budget 1: versions 0 and 1 are over budget even though n=1 needs only one
    assert groups_of(controller.drain_freshest(1, max_staleness=1)) == ["v3"]
    assert controller.buffered == 1
    assert groups_of(controller.pop_evicted()) == ["v0", "v1"]


def test_drain_freshest_at_the_staleness_limit_keeps_the_group():
    controller, _ = make_controller()
    fill(controller, [["v0"], ["v1"]])
    assert groups_of(controller.drain_freshest(2, max_staleness=1)) == ["v1", "v0"]
    assert controller.pop_evicted() == []


def test_drain_freshest_without_max_staleness_evicts_nothing():
    controller, _ = make_controller()
    fill(controller, [["v0"], [], [], ["v3"]])
    assert groups_of(controller.drain_freshest(2)) == ["v3", "v0"]
    assert controller.pop_evicted() == []


def test_eviction_happens_even_when_the_drain_then_returns_none():
    controller, launcher = make_controller()
    fill(controller, [["v0"], ["v1"]])
    controller.submit("in-flight")
    assert controller.drain_freshest(2, max_staleness=0) is None
    assert groups_of(controller.pop_evicted()) == ["v0"]
    assert controller.buffered == 1


def test_eviction_can_make_a_drain_unsatisfiable_when_nothing_is_in_flight():
    controller, _ = make_controller()
    fill(controller, [["v0"], ["v1"]])
    with pytest.raises(RuntimeError, match="n=2"):
        controller.drain_freshest(2, max_staleness=0)
    assert groups_of(controller.pop_evicted()) == ["v0"]


def test_pop_evicted_returns_each_evicted_group_exactly_once():
    controller, _ = make_controller()
    fill(controller, [["v0-a", "v0-b"], ["v1"]])
    controller.drain_freshest(1, max_staleness=0)
    evicted = controller.pop_evicted()
    assert [(item.gen_id, item.weight_version, item.group) for item in evicted] == [
        (0, 0, "v0-a"),
        (1, 0, "v0-b"),
    ]
    assert controller.pop_evicted() == []


# --- sync_weights ----------------------------------------------------------------------------------


def test_sync_weights_refuses_while_anything_is_in_flight_naming_the_gen_ids():
    controller, _ = make_controller(start_gen_id=10)
    controller.submit("a")
    controller.submit("b")
    pushed: list[int] = []
    with pytest.raises(RuntimeError, match=r"2 generation\(s\) still in flight \(gen_ids \[10, 11\]\)"):
        controller.sync_weights(pushed.append)
    assert pushed == []
    assert controller.weight_version == 0


def test_sync_weights_pushes_the_new_version_once_then_bumps():
    controller, _ = make_controller(start_weight_version=4)
    pushed: list[int] = []

    def push(new_version: int) -> None:
        assert controller.weight_version == 4  # bumped only after the push returned
        pushed.append(new_version)

    assert controller.sync_weights(push) == 5
    assert pushed == [5]
    assert controller.weight_version == 5


def test_sync_weights_does_not_bump_the_version_when_push_raises():
    controller, _ = make_controller()

    def push(new_version: int) -> None:
        raise OSError("collective timed out")

    with pytest.raises(OSError):
        controller.sync_weights(push)
    assert controller.weight_version == 0


# --- launch_ceiling --------------------------------------------------------------------------------


def test_launch_ceiling_is_synchronous_at_max_staleness_0_and_sync_interval_1():
    assert [launch_ceiling(step, 1, 0, 100) for step in range(5)] == [1, 2, 3, 4, 5]


def test_launch_ceiling_is_capped_by_num_rollouts():
    assert launch_ceiling(9, 4, 3, num_rollouts=10) == 10
    assert launch_ceiling(0, 1, 0, num_rollouts=0) == 0


@pytest.mark.parametrize("sync_interval", [1, 2, 3, 4, 7])
def test_at_max_staleness_0_no_launched_gen_id_crosses_the_next_sync_boundary(sync_interval):
    num_rollouts = 5 * sync_interval + 2
    controller, _ = make_controller(ready=True)
    launch_version: dict[int, int] = {}
    for step in range(num_rollouts):
        ceiling = launch_ceiling(step, sync_interval, 0, num_rollouts)
        controller.launch_until(ceiling, max_inflight=100, build=lambda gen_id: gen_id)
        for gen_id in range(len(launch_version), controller.next_gen_id):
            launch_version[gen_id] = step // sync_interval
        controller.poll()
        (item,) = controller.drain_freshest(1, max_staleness=0)
        assert item.gen_id == step
        if (step + 1) % sync_interval == 0:
            controller.quiesce()
            controller.sync_weights(lambda new_version: None)
    # gen_id g is trained at step g under version g // sync_interval: the version it was launched under
    assert all(version == gen_id // sync_interval for gen_id, version in launch_version.items())
    assert controller.pop_evicted() == []


@pytest.mark.parametrize("sync_interval", [1, 2, 5])
@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_launch_ceiling_keeps_every_launched_gen_id_within_its_staleness_budget(sync_interval, max_staleness):
    num_rollouts = 40
    for step in range(num_rollouts):
        ceiling = launch_ceiling(step, sync_interval, max_staleness, num_rollouts)
        assert ceiling > step  # the rollout trained at this step may always be launched
        for gen_id in range(step, ceiling):
            assert gen_id // sync_interval - step // sync_interval <= max_staleness
        if ceiling < num_rollouts:  # and the bound is tight: the next gen_id would be over budget
            assert ceiling // sync_interval - step // sync_interval == max_staleness + 1


# --- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ((-1, 1, 0, 10), "rollout_id must be >= 0, got -1"),
        ((0, 0, 0, 10), "sync_interval must be >= 1, got 0"),
        ((0, 1, -1, 10), "max_staleness must be >= 0, got -1"),
        ((0, 1, 0, -5), "num_rollouts must be >= 0, got -5"),
    ],
)
def test_launch_ceiling_rejects_bad_input_naming_the_argument_and_value(arguments, message):
    with pytest.raises(ValueError, match=message):
        launch_ceiling(*arguments)


@pytest.mark.parametrize("n", [0, -3])
def test_drain_freshest_rejects_n_below_1(n):
    controller, _ = make_controller()
    with pytest.raises(ValueError, match=f"n must be >= 1, got {n}"):
        controller.drain_freshest(n)


def test_drain_freshest_rejects_negative_max_staleness_without_evicting():
    controller, _ = make_controller()
    fill(controller, [["v0"], ["v1"]])
    with pytest.raises(ValueError, match="max_staleness must be >= 0, got -1"):
        controller.drain_freshest(1, max_staleness=-1)
    assert controller.buffered == 2


@pytest.mark.parametrize("max_inflight", [0, -1])
def test_launch_until_rejects_max_inflight_below_1(max_inflight):
    controller, _ = make_controller()
    with pytest.raises(ValueError, match=f"max_inflight must be >= 1, got {max_inflight}"):
        controller.launch_until(10, max_inflight=max_inflight, build=lambda gen_id: gen_id)
    assert controller.inflight == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start_gen_id": -1}, "start_gen_id must be >= 0, got -1"),
        ({"start_weight_version": -2}, "start_weight_version must be >= 0, got -2"),
    ],
)
def test_controller_rejects_negative_start_counters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BatchRolloutController(FakeLauncher(), **kwargs)


# --- the mechanisms on their own -------------------------------------------------------------------


def test_versioned_buffer_take_freshest_spans_versions_and_consumes_nothing_when_short():
    buffer = VersionedBuffer()
    for gen_id, version in enumerate([0, 2, 1, 2, 0]):
        buffer.insert(StampedGroup(gen_id, version, f"g{gen_id}"))
    assert buffer.take_freshest(6) is None
    assert len(buffer) == 5
    assert [item.gen_id for item in buffer.take_freshest(3)] == [1, 3, 2]
    assert [item.gen_id for item in buffer.take_freshest(2)] == [0, 4]
    assert len(buffer) == 0


def test_versioned_buffer_evict_older_than_moves_whole_versions_oldest_first():
    buffer = VersionedBuffer()
    for gen_id, version in enumerate([3, 1, 2, 1]):
        buffer.insert(StampedGroup(gen_id, version, None))
    assert buffer.evict_older_than(3) == 3
    assert [item.gen_id for item in buffer.pop_evicted()] == [1, 3, 2]
    assert len(buffer) == 1


def test_inflight_pool_rejects_a_gen_id_already_in_flight():
    pool = InflightPool()
    pool.add(1, 0, FakeGenerationHandle("a"))
    with pytest.raises(ValueError, match="gen_id 1 is already in flight"):
        pool.add(1, 0, FakeGenerationHandle("b"))
