"""Pins the contract of ``unirl_lightning.agentic.controller`` against a small fake coordinator."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from unirl_lightning.agentic.controller import AgenticRolloutController, SiblingAssembler, root_of
from unirl_lightning.rollout.controller import StampedGroup


@dataclass(frozen=True)
class Sample:
    sample_id: str


class FakeCoordinator:
    """The coordinator contract from the module docstring, driven by the test.

    ``finish(*ids)`` makes requests complete (visible to the next ``poll``); ``finish_during_abort``
    lists the ids that complete while ``abort`` runs.
    """

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.running: list[str] = []
        self.unpolled: list[Sample] = []
        self.finish_during_abort: list[str] = []
        self.fail_next_submit = False

    def submit(self, requests: list[str]) -> None:
        self.calls.append("submit")
        if self.fail_next_submit:
            self.fail_next_submit = False
            raise ConnectionError("coordinator unreachable")
        self.running.extend(requests)

    def finish(self, *sample_ids: str) -> None:
        for sample_id in sample_ids:
            self.running.remove(sample_id)
            self.unpolled.append(Sample(sample_id))

    def poll(self) -> list[Sample]:
        self.calls.append("poll")
        completed, self.unpolled = self.unpolled, []
        return completed

    def finalize_if_drained(self) -> bool:
        self.calls.append("finalize_if_drained")
        return not self.running and not self.unpolled

    def abort(self) -> list[Sample]:
        self.calls.append("abort")
        finished = [Sample(sample_id) for sample_id in self.finish_during_abort]
        self.finish_during_abort = []
        self.running = []
        return finished


def make_controller(group_size: int = 2, **kwargs) -> tuple[AgenticRolloutController, FakeCoordinator]:
    coordinator = FakeCoordinator()
    return AgenticRolloutController(coordinator, group_size=group_size, **kwargs), coordinator


def ids_of(group: list[Sample]) -> list[str]:
    return [sample.sample_id for sample in group]


def no_push(new_version: int) -> None:
    pass


# --- root_of ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sample_id", "root"), [("prompt-7/3", "prompt-7"), ("prompt-7", "prompt-7"), ("p/0/turn-2", "p")]
)
def test_root_of_is_the_part_before_the_first_slash(sample_id, root):
    assert root_of(sample_id) == root


@pytest.mark.parametrize(("sample_id", "message"), [("", "''"), ("/3", "'/3'"), (7, "int 7")])
def test_root_of_rejects_ids_without_a_root_naming_the_value(sample_id, message):
    with pytest.raises(ValueError, match=f"sample_id must .*got {message}"):
        root_of(sample_id)


# --- SiblingAssembler ---------------------------------------------------------------------------------


def test_pending_groups_emits_a_group_only_once_all_n_siblings_arrived():
    pending = SiblingAssembler(group_size=3)
    assert pending.add([Sample("a/0"), Sample("a/1")]) == []
    assert pending.arrived("a") == 2
    (group,) = pending.add([Sample("a/2")])
    assert ids_of(group) == ["a/0", "a/1", "a/2"]
    assert len(pending) == 0


def test_pending_groups_keeps_arrival_order_within_a_group_and_completion_order_across_groups():
    pending = SiblingAssembler(group_size=2)
    completed = pending.add([Sample("a/1"), Sample("b/0"), Sample("b/1"), Sample("a/0")])
    assert [ids_of(group) for group in completed] == [["b/0", "b/1"], ["a/1", "a/0"]]


def test_pending_groups_rejects_a_duplicate_sibling_and_adds_nothing_from_that_batch():
    pending = SiblingAssembler(group_size=3)
    pending.add([Sample("a/0")])
    with pytest.raises(ValueError, match="sample_id 'a/0' arrived twice for group 'a'"):
        pending.add([Sample("b/0"), Sample("a/0")])
    assert pending.tail_roots() == ["a"]
    with pytest.raises(ValueError, match="'b/0' arrived twice"):
        pending.add([Sample("b/0"), Sample("b/0")])
    assert len(pending) == 1


def test_pending_groups_discard_forgets_incomplete_groups_and_counts_their_samples():
    pending = SiblingAssembler(group_size=3)
    pending.add([Sample("a/0"), Sample("a/1"), Sample("b/0")])
    assert pending.discard(["a", "missing"]) == 2
    assert pending.tail_roots() == ["b"]


@pytest.mark.parametrize("group_size", [0, -2])
def test_pending_groups_rejects_group_size_below_1(group_size):
    with pytest.raises(ValueError, match=f"group_size must be >= 1, got {group_size}"):
        SiblingAssembler(group_size)


# --- stamps and gen_ids ----------------------------------------------------------------------------


def test_groups_get_consecutive_gen_ids_from_start_gen_id_in_completion_order():
    controller, coordinator = make_controller(start_gen_id=10)
    controller.submit(["a/0", "a/1", "b/0", "b/1"])
    coordinator.finish("b/0", "b/1")
    assert controller.poll() == 1
    coordinator.finish("a/0", "a/1")
    assert controller.poll() == 1
    drained = controller.drain_freshest(2)
    assert [(item.gen_id, ids_of(item.group)) for item in drained] == [
        (10, ["b/0", "b/1"]),
        (11, ["a/0", "a/1"]),
    ]
    assert controller.next_gen_id == 12


def test_a_group_is_stamped_with_the_version_current_when_its_last_sibling_completes():
    controller, coordinator = make_controller(tail_policy="carry", start_weight_version=3)
    controller.submit(["a/0", "a/1"])
    coordinator.finish("a/0")
    controller.poll()
    controller.quiesce()  # a/1 was aborted; the group is carried
    assert controller.sync_weights(no_push) == 4
    controller.submit(["a/1"])  # the missing sibling, regenerated under version 4
    coordinator.finish("a/1")
    controller.poll()
    (item,) = controller.drain_freshest(1)
    assert item.weight_version == 4
    assert isinstance(item, StampedGroup)


# --- quiesce ---------------------------------------------------------------------------------------


def test_quiesce_is_abort_then_exactly_one_final_poll():
    controller, coordinator = make_controller()
    controller.submit(["a/0", "a/1"])
    coordinator.calls.clear()
    controller.quiesce()
    assert coordinator.calls == ["abort", "poll"]
    assert not controller.drive_live


def test_groups_finishing_during_quiesce_keep_the_pre_sync_version():
    controller, coordinator = make_controller(start_weight_version=5)
    controller.submit(["a/0", "a/1", "b/0", "b/1"])
    coordinator.finish("a/0", "b/0", "b/1")  # completed before the abort, never polled
    coordinator.finish_during_abort = ["a/1"]
    assert controller.quiesce() == 2
    controller.sync_weights(no_push)
    drained = controller.drain_freshest(2)
    assert {item.weight_version for item in drained} == {5}
    assert controller.weight_version == 6


def test_quiesce_with_no_live_drive_does_nothing():
    controller, coordinator = make_controller()
    assert controller.quiesce() == 0
    assert coordinator.calls == []


# --- tail policies ---------------------------------------------------------------------------------


def test_carry_keeps_incomplete_groups_for_the_next_drive_and_counts_them():
    controller, coordinator = make_controller(tail_policy="carry")
    controller.submit(["a/0", "a/1", "b/0", "b/1"])
    coordinator.finish("a/0", "b/0")
    controller.poll()
    controller.quiesce()
    assert (controller.carried, controller.dropped) == (2, 0)
    assert controller.tail_roots() == ["a", "b"]
    controller.submit(["a/1", "b/1"])
    coordinator.finish("a/1", "b/1")
    assert controller.poll() == 2
    assert controller.finalize_if_drained()
    assert controller.pending_groups == 0
    assert controller.carried == 2


def test_drop_discards_incomplete_groups_and_counts_groups_and_samples():
    controller, coordinator = make_controller(tail_policy="drop", group_size=3)
    controller.submit(["a/0", "a/1", "a/2", "b/0", "b/1", "b/2"])
    coordinator.finish("a/0", "a/1", "b/0")
    controller.poll()
    controller.quiesce()
    assert (controller.dropped, controller.dropped_samples, controller.carried) == (2, 3, 0)
    assert controller.pending_groups == 0
    assert controller.tail_roots() == []


def test_drop_discards_siblings_of_a_dropped_group_that_arrive_later():
    controller, coordinator = make_controller(tail_policy="drop")
    controller.submit(["a/0", "a/1"])
    coordinator.finish("a/0")
    controller.poll()
    controller.quiesce()
    controller.submit(["a/1", "c/0", "c/1"])  # e.g. a coordinator that resumes aborted trajectories
    coordinator.finish("a/1", "c/0", "c/1")
    assert controller.poll() == 1
    assert controller.pending_groups == 0
    assert controller.dropped_samples == 2
    assert [ids_of(item.group) for item in controller.drain_freshest(1)] == [["c/0", "c/1"]]


def test_tail_policy_also_applies_when_a_drive_ends_by_finalize():
    controller, coordinator = make_controller(tail_policy="drop")
    controller.submit(["a/0"])  # only one sibling of "a" in this drive
    coordinator.finish("a/0")
    controller.poll()
    assert controller.finalize_if_drained()
    assert controller.dropped == 1


# --- drive guard / finalize ------------------------------------------------------------------------


def test_second_submit_while_a_drive_is_live_is_refused():
    controller, coordinator = make_controller()
    controller.submit(["a/0", "a/1"])
    with pytest.raises(RuntimeError, match="submit refused: the previous drive is still live"):
        controller.submit(["b/0", "b/1"])
    assert coordinator.calls == ["submit"]


def test_submit_is_allowed_again_once_finalize_if_drained_reports_the_drive_over():
    controller, coordinator = make_controller()
    controller.submit(["a/0", "a/1"])
    coordinator.finish("a/0", "a/1")
    assert not controller.finalize_if_drained()  # completions not yet polled: the drive is not over
    assert controller.drive_live
    controller.poll()
    assert controller.finalize_if_drained()
    controller.submit(["b/0", "b/1"])
    assert controller.drive_live


def test_finalize_if_drained_with_no_live_drive_is_true_without_asking_the_coordinator():
    controller, coordinator = make_controller()
    assert controller.finalize_if_drained()
    assert coordinator.calls == []


def test_a_failed_coordinator_submit_keeps_the_drive_guarded_until_quiesce():
    controller, coordinator = make_controller()
    coordinator.fail_next_submit = True
    with pytest.raises(ConnectionError):
        controller.submit(["a/0", "a/1"])
    with pytest.raises(RuntimeError, match="still live"):
        controller.submit(["a/0", "a/1"])
    controller.quiesce()
    controller.submit(["a/0", "a/1"])


def test_poll_with_no_live_drive_returns_0_without_asking_the_coordinator():
    controller, coordinator = make_controller()
    assert controller.poll() == 0
    assert coordinator.calls == []


def test_a_duplicate_completion_raises_and_inserts_nothing():
    controller, coordinator = make_controller()
    controller.submit(["a/0", "a/1"])
    coordinator.unpolled = [Sample("a/0"), Sample("a/0"), Sample("a/1")]
    with pytest.raises(ValueError, match="arrived twice"):
        controller.poll()
    assert (controller.buffered, controller.pending_groups) == (0, 0)


# --- sync_weights ----------------------------------------------------------------------------------


def test_sync_weights_is_refused_while_a_drive_is_live():
    controller, _ = make_controller()
    controller.submit(["a/0", "a/1"])
    pushed: list[int] = []
    with pytest.raises(RuntimeError, match="sync_weights refused: a drive is live"):
        controller.sync_weights(pushed.append)
    assert pushed == []
    assert controller.weight_version == 0


def test_sync_weights_pushes_the_new_version_once_then_bumps():
    controller, _ = make_controller(start_weight_version=2)
    pushed: list[int] = []
    assert controller.sync_weights(pushed.append) == 3
    assert pushed == [3]
    assert controller.weight_version == 3


def test_sync_weights_does_not_bump_when_push_raises():
    controller, _ = make_controller()

    def push(new_version: int) -> None:
        raise OSError("push failed")

    with pytest.raises(OSError):
        controller.sync_weights(push)
    assert controller.weight_version == 0


# --- drain_freshest / pop_evicted (the batch controller's semantics) --------------------------------


def run_drive(controller: AgenticRolloutController, coordinator: FakeCoordinator, roots: list[str]) -> None:
    sample_ids = [f"{root}/{index}" for root in roots for index in range(2)]
    controller.submit(sample_ids)
    coordinator.finish(*sample_ids)
    controller.poll()
    assert controller.finalize_if_drained()


def test_drain_freshest_returns_the_freshest_and_evicts_over_budget_once():
    controller, coordinator = make_controller()
    for version, roots in enumerate([["v0a", "v0b"], ["v1"], ["v2"]]):
        if version:
            controller.sync_weights(no_push)
        run_drive(controller, coordinator, roots)
    drained = controller.drain_freshest(1, max_staleness=1)
    assert [root_of(item.group[0].sample_id) for item in drained] == ["v2"]
    evicted = controller.pop_evicted()
    assert [root_of(item.group[0].sample_id) for item in evicted] == ["v0a", "v0b"]
    assert controller.pop_evicted() == []
    assert controller.buffered == 1


def test_drain_freshest_short_during_a_live_drive_returns_none_and_consumes_nothing():
    controller, coordinator = make_controller()
    controller.submit(["a/0", "a/1", "b/0", "b/1"])
    coordinator.finish("a/0", "a/1")
    controller.poll()
    assert controller.drain_freshest(2) is None
    assert controller.buffered == 1


def test_drain_freshest_short_with_no_live_drive_raises_naming_n_and_the_buffered_count():
    controller, coordinator = make_controller()
    run_drive(controller, coordinator, ["a"])
    with pytest.raises(RuntimeError, match=r"n=2.*only 1 group\(s\) are buffered.*nothing is in flight"):
        controller.drain_freshest(2)


# --- bad input -------------------------------------------------------------------------------------


def test_unknown_tail_policy_is_rejected_naming_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"tail_policy must be one of \('carry', 'drop'\), got 'keep'"):
        make_controller(tail_policy="keep")


def test_group_size_below_1_is_rejected():
    with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
        make_controller(group_size=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start_gen_id": -1}, "start_gen_id must be >= 0, got -1"),
        ({"start_weight_version": -1}, "start_weight_version must be >= 0, got -1"),
    ],
)
def test_negative_start_counters_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_controller(**kwargs)


def test_empty_submit_is_rejected_and_starts_no_drive():
    controller, coordinator = make_controller()
    with pytest.raises(ValueError, match="requests must hold at least one request, got 0"):
        controller.submit([])
    assert not controller.drive_live
    assert coordinator.calls == []


def test_drain_freshest_rejects_bad_n_and_max_staleness():
    controller, _ = make_controller()
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        controller.drain_freshest(0)
    with pytest.raises(ValueError, match="max_staleness must be >= 0, got -2"):
        controller.drain_freshest(1, max_staleness=-2)
