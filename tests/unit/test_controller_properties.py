"""Property test of ``BatchRolloutController``: random interleavings never lose, repeat or over-age a group.

Rules: submit / make a job ready / arm a one-shot failure (in ``result()`` or in ``complete``) /
poll / drain (random ``n`` and ``max_staleness``) / quiesce then sync. After every step:

* every group ever inserted is exactly one of: drained once, evicted once, still buffered;
* a job is completed successfully at most once, and is in flight until it is;
* nothing drained is over the staleness budget at drain time, and everything evicted was;
* every group carries its job's launch-time version, and the weight version never decreases.
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.fakes import FakeGenerationHandle
from unirl_lightning.rollout.controller import BatchRolloutController, StampedGroup


class InjectedFailure(Exception):
    """A failure the test injected; never raised by the controller itself."""


class ControllerMachine(RuleBasedStateMachine):
    @initialize(start_gen_id=st.integers(0, 5), start_weight_version=st.integers(0, 3))
    def start(self, start_gen_id: int, start_weight_version: int) -> None:
        self.pendings: dict[int, FakeGenerationHandle] = {}
        self.launch_version: dict[int, int] = {}
        self.fail_complete_once: set[int] = set()
        self.successful_completions: dict[int, int] = {}
        self.inserted: set[tuple[int, int]] = set()
        self.drained: list[StampedGroup] = []
        self.evicted: list[StampedGroup] = []
        self.versions_seen = [start_weight_version]
        self.expected_next_gen_id = start_gen_id
        self.controller = BatchRolloutController(
            self.launch,
            complete=self.complete,
            start_gen_id=start_gen_id,
            start_weight_version=start_weight_version,
        )

    def launch(self, groups_per_job: int) -> FakeGenerationHandle:
        pending = FakeGenerationHandle(groups_per_job)
        self.pendings[self.controller.next_gen_id] = pending  # the gen_id submit is about to hand out
        return pending

    def complete(self, gen_id: int, weight_version: int, groups_per_job: Any) -> list[tuple[int, int]]:
        if gen_id in self.fail_complete_once:
            self.fail_complete_once.discard(gen_id)
            raise InjectedFailure("complete")
        assert weight_version == self.launch_version[gen_id]
        groups = [(gen_id, index) for index in range(groups_per_job)]
        self.successful_completions[gen_id] = self.successful_completions.get(gen_id, 0) + 1
        self.inserted.update(groups)
        return groups

    def in_flight_gen_ids(self) -> list[int]:
        return [gen_id for gen_id in self.pendings if gen_id not in self.successful_completions]

    @rule(groups_per_job=st.integers(0, 3))
    def submit(self, groups_per_job: int) -> None:
        gen_id = self.controller.submit(groups_per_job)
        assert gen_id == self.expected_next_gen_id
        self.expected_next_gen_id += 1
        self.launch_version[gen_id] = self.controller.weight_version

    def _pick_in_flight(self, data: st.DataObject) -> int | None:
        in_flight = self.in_flight_gen_ids()
        return data.draw(st.sampled_from(in_flight)) if in_flight else None

    @rule(data=st.data())
    def make_ready(self, data: st.DataObject) -> None:
        gen_id = self._pick_in_flight(data)
        if gen_id is not None:
            self.pendings[gen_id].is_ready = True

    @rule(data=st.data(), where=st.sampled_from(["result", "complete"]))
    def fail_once(self, data: st.DataObject, where: str) -> None:
        gen_id = self._pick_in_flight(data)
        if gen_id is None:
            return
        if where == "result":
            self.pendings[gen_id].failures_left = 1
            self.pendings[gen_id].failure = InjectedFailure("result")
        else:
            self.fail_complete_once.add(gen_id)

    @rule()
    def poll(self) -> None:
        try:
            self.controller.poll()
        except InjectedFailure:
            pass

    @rule(n=st.integers(1, 5), max_staleness=st.none() | st.integers(0, 2))
    def drain(self, n: int, max_staleness: int | None) -> None:
        current_version = self.controller.weight_version
        try:
            items = self.controller.drain_freshest(n, max_staleness=max_staleness)
        except RuntimeError:
            assert self.controller.inflight == 0
            assert self.controller.buffered < n
            items = []
        else:
            if items is None:
                assert self.controller.inflight > 0
                assert self.controller.buffered < n
                items = []
            else:
                assert len(items) == n
        versions = [item.weight_version for item in items]
        assert versions == sorted(versions, reverse=True), "freshest first"
        evicted = self.controller.pop_evicted()
        if max_staleness is not None:
            assert all(item.weight_version >= current_version - max_staleness for item in items)
            assert all(item.weight_version < current_version - max_staleness for item in evicted)
        else:
            assert evicted == []
        self.drained.extend(items)
        self.evicted.extend(evicted)

    @rule()
    def quiesce_then_sync(self) -> None:
        version_before = self.controller.weight_version
        try:
            self.controller.quiesce()
        except InjectedFailure:
            assert self.controller.inflight > 0
            try:
                self.controller.sync_weights(lambda new_version: None)
            except RuntimeError:
                pass
            else:
                raise AssertionError("sync_weights must refuse while a failed job is in flight")
            assert self.controller.weight_version == version_before
            return
        assert self.controller.inflight == 0
        pushed: list[int] = []
        assert self.controller.sync_weights(pushed.append) == version_before + 1
        assert pushed == [version_before + 1]

    @invariant()
    def every_group_is_drained_evicted_or_buffered_exactly_once(self) -> None:
        handed_out = [item.group for item in self.drained] + [item.group for item in self.evicted]
        assert len(handed_out) == len(set(handed_out)), "a group was handed out twice"
        assert set(handed_out) <= self.inserted
        assert len(self.inserted) == len(handed_out) + self.controller.buffered

    @invariant()
    def every_job_completes_at_most_once_and_is_in_flight_until_it_does(self) -> None:
        assert all(count == 1 for count in self.successful_completions.values())
        assert self.controller.inflight == len(self.in_flight_gen_ids())

    @invariant()
    def groups_carry_their_launch_version_and_versions_never_decrease(self) -> None:
        for item in self.drained[-5:] + self.evicted[-5:]:
            assert item.weight_version == self.launch_version[item.gen_id]
            assert item.group[0] == item.gen_id
        assert self.controller.weight_version >= self.versions_seen[-1]
        self.versions_seen.append(self.controller.weight_version)


ControllerMachine.TestCase.settings = settings(max_examples=200, deadline=None, stateful_step_count=40)
test_controller_never_loses_repeats_or_over_ages_a_group = ControllerMachine.TestCase
