"""Pins the AgenticRolloutLoop's policy (refill, poll, drain freshest, finalize) over the real
AgenticRolloutController and a scripted coordinator: how much a drive holds, the tail policy after a
quiesce (carry resumes the suspended episodes, drop discards them), failed groups, and the accounting
that keeps any episode from being lost silently."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from unirl_lightning.agentic.controller import AgenticRolloutController, root_of
from unirl_lightning.agentic.loop import AgenticRolloutLoop
from unirl_lightning.rollout.records import AgenticRollout


class ScriptedCoordinator:
    """Episodes of records with ``"long": True`` run until aborted (then they are suspended); all
    others, and every resumed episode, finish at the next poll. ``"fail": True`` episodes finish
    with an environment error."""

    def __init__(self) -> None:
        self.submits: list[list] = []
        self.running: list = []
        self._suspended: list = []
        self.forget_suspended = False

    def submit(self, requests):
        self.submits.append(list(requests))
        resumed = {r.sample_id for r in self._suspended}
        self.running = [(r, r.sample_id in resumed) for r in requests]
        self._suspended = []

    def _finished(self, request, resumed):
        return resumed or not request.record.get("long")

    def poll(self):
        done = [(r, res) for r, res in self.running if self._finished(r, res)]
        self.running = [(r, res) for r, res in self.running if not self._finished(r, res)]
        return [self._sample(r) for r, _ in done]

    def finalize_if_drained(self):
        return not self.running

    def abort(self):
        self._suspended = [] if self.forget_suspended else [r for r, _ in self.running]
        self.running = []
        return []

    def suspended(self):
        return [r.sample_id for r in self._suspended]

    @staticmethod
    def _sample(request):
        error = "environment FakeEnv raised in step (turn 1)" if request.record.get("fail") else None
        sample = AgenticRollout(
            [1], [5, 2], [-1.0, -1.0], 1.0, "stop", loss_mask=[1, 1], sample_id=request.sample_id
        )
        sample.env_error, sample.num_turns, sample.turn_versions = error, 1, [0]
        sample.reward_timeouts = request.record.get("timeouts", 0)  # the environment's checks that ran out
        return sample


def batches(*kinds: str, size: int = 2):
    """Prompt batches: ``"short"``, ``"long"`` (runs until a quiesce) or ``"fail"`` (one failing prompt)."""
    out = []
    for b, kind in enumerate(kinds):
        records = [{"prompt": f"{b}-{i}", "long": kind == "long"} for i in range(size)]
        if kind == "fail":
            records[0]["fail"] = True
        out.append(records)
    return out


def make_loop(prompts, tail_policy="carry", max_staleness=1, max_inflight=2):
    coordinator = ScriptedCoordinator()
    controller = AgenticRolloutController(coordinator, group_size=2, tail_policy=tail_policy)
    loop = AgenticRolloutLoop(
        prompts,
        controller,
        coordinator,
        collate=lambda groups: SimpleNamespace(groups=groups, stats={}),
        num_generations=2,
        max_staleness=max_staleness,
        max_inflight=max_inflight,
        poll_interval_s=0.0,
    )
    return loop, controller, coordinator


def sync(controller):
    controller.quiesce()
    controller.sync_weights(lambda version: None)


def roots(batch) -> list[str]:
    return [root_of(group[0].sample_id) for group in batch.groups]


def test_a_drive_holds_max_inflight_steps_of_groups_and_only_one_step_at_max_staleness_0():
    loop, _, coordinator = make_loop(batches("short", "short", "short"), max_staleness=1, max_inflight=2)
    assert roots(loop.next_batch()) == ["g0", "g1"]
    assert [r.sample_id for r in coordinator.submits[0]] == [f"g{g}/{k}" for g in range(4) for k in range(2)]
    loop, _, coordinator = make_loop(batches("short", "short"), max_staleness=0, max_inflight=2)
    loop.next_batch()
    assert len(coordinator.submits[0]) == 4  # one step of groups: nothing to evict after the sync


def test_carry_resubmits_the_suspended_episodes_after_the_new_groups_and_trains_them_later():
    loop, controller, coordinator = make_loop(batches("short", "long", "short", "short"))
    assert roots(loop.next_batch()) == ["g0", "g1"]
    sync(controller)  # interrupts g2 and g3 (no sibling arrived: the loop carries them itself)
    assert roots(loop.next_batch()) == ["g4", "g5"]
    second = [r.sample_id for r in coordinator.submits[1]]
    assert second == ["g4/0", "g4/1", "g5/0", "g5/1", "g2/0", "g2/1", "g3/0", "g3/1"]
    assert loop.carried == 2 and loop.dropped == 0
    assert roots(loop.next_batch()) == ["g2", "g3"]  # the carried tails finish later
    assert sorted(loop.pending) == [] and list(loop.trained_roots) == ["g0", "g1", "g4", "g5", "g2", "g3"]


def test_drop_discards_the_interrupted_groups_which_never_reach_training():
    loop, controller, coordinator = make_loop(batches("short", "long", "short", "short"), tail_policy="drop")
    loop.next_batch()
    sync(controller)
    assert roots(loop.next_batch()) == ["g4", "g5"]
    # nothing carried: two new prompt batches fill the window, and no request resumes g2/g3
    assert [r.sample_id for r in coordinator.submits[1]] == [
        f"g{g}/{k}" for g in range(4, 8) for k in range(2)
    ]
    assert loop.dropped == 2 and list(loop.dropped_roots) == ["g2", "g3"]
    sync(controller)
    loop.next_batch()
    trained = set(loop.trained_roots)
    assert not trained & {"g2", "g3"}
    submitted = {f"g{i}" for i in range(loop.next_root)}
    assert trained | set(loop.dropped_roots) | set(loop.pending) | set(loop.evicted_roots) == submitted


def test_a_group_with_a_failed_episode_is_counted_and_never_trained():
    loop, _, _ = make_loop(batches("fail", "short", "short"), max_staleness=0, max_inflight=1)
    batch = loop.next_batch()
    assert roots(batch) == ["g1"]  # g0 had a crashing environment
    assert (loop.failed_groups, loop.env_errors, list(loop.failed_roots)) == (1, 2, ["g0"])
    assert batch.stats["agentic/env_errors"] == 2.0 and batch.stats["agentic/failed_groups"] == 1.0


def test_the_environments_answer_checks_that_ran_out_are_summed_logged_once_one_did_and_checkpointed():
    prompts = batches("short", "short", "short", "short")
    prompts[1][0]["timeouts"], prompts[2][1]["timeouts"] = 2, 1  # per episode, in one group of each batch
    loop, controller, _ = make_loop(prompts, max_staleness=0, max_inflight=1)
    logged = []
    for _ in range(3):
        logged.append(loop.next_batch().stats.get("rollout/reward_timeouts"))
        sync(controller)
    assert logged == [None, 4.0, 6.0]  # batch 1: a group of 2 episodes at 2 each; batch 2: 2 x 1 more
    resumed, _, _ = make_loop(prompts, max_staleness=0, max_inflight=1)
    resumed.load_loop_state(loop.loop_state())
    assert resumed.next_batch().stats["rollout/reward_timeouts"] == 6.0  # the run's total, not lost


def test_a_coordinator_that_loses_an_interrupted_group_is_caught_before_the_next_drive():
    loop, controller, coordinator = make_loop(batches("short", "long", "short"))
    loop.next_batch()
    coordinator.forget_suspended = True  # g2 and g3 were live; no sibling had arrived
    sync(controller)
    with pytest.raises(RuntimeError, match=r"4 group\(s\): 2 completed.*suspended episodes of \[\].*lost"):
        loop.next_batch()


def test_a_tail_the_controller_kept_without_suspended_episodes_raises():
    loop, controller, coordinator = make_loop(batches("short", "long", "short"))
    loop.next_batch()
    sync(controller)
    coordinator._suspended = [r for r in coordinator.submits[0] if r.sample_id == "g3/0"]
    controller._pending.add([ScriptedCoordinator._sample(SimpleNamespace(sample_id="g2/0", record={}))])
    with pytest.raises(RuntimeError, match=r"kept \['g2'\].*lost or trained twice"):
        loop.next_batch()


def test_state_dict_keeps_the_untrained_groups_and_a_resumed_loop_submits_them_first():
    prompts = batches("short", "long", "short", "short")
    loop, controller, _ = make_loop(prompts)
    loop.next_batch()
    sync(controller)  # g2, g3 interrupted: not trained yet
    state = loop.loop_state()
    assert state["untrained"] == prompts[1] and state["steps"] == 1 and state["next_root"] == 4
    resumed, _, coordinator = make_loop(prompts)
    resumed.load_loop_state(state)
    assert roots(resumed.next_batch()) == ["g6", "g7"]  # the short batch that follows in the stream
    first_drive = coordinator.submits[0]
    assert [r.sample_id for r in first_drive[:4]] == ["g4/0", "g4/1", "g5/0", "g5/1"]
    assert [first_drive[0].record, first_drive[2].record] == prompts[1]  # replayed first, as new groups


def test_a_step_where_no_group_completes_within_the_stall_timeout_raises():
    loop, _, _ = make_loop(batches("long", "long"))
    loop.stall_timeout_s = 0.05
    with pytest.raises(TimeoutError, match="no agentic group completed for .* seems to hang"):
        loop.next_batch()


# --- the other clock: the oldest turn (max_turn_staleness) ----------------------------------------


class TurnCoordinator:
    """Every live episode plays one turn per poll under ``version`` (the weights the test pushed); an
    episode of a record with ``"turns": t`` finishes after ``t`` turns. ``abort`` suspends the live
    episodes with their turn versions; a ``submit`` resumes those it names."""

    def __init__(self) -> None:
        self.version = 0
        self.live: dict[str, tuple] = {}
        self._suspended: dict[str, tuple] = {}

    def submit(self, requests):
        self.live = {r.sample_id: self._suspended.get(r.sample_id) or (r, []) for r in requests}
        self._suspended = {}

    def poll(self):
        done = []
        for sample_id, (request, versions) in list(self.live.items()):
            versions.append(self.version)
            if len(versions) >= request.record["turns"]:
                del self.live[sample_id]
                turns = len(versions)
                sample = AgenticRollout([1], [5] * turns, [-1.0] * turns, 1.0, "stop", loss_mask=[1] * turns)
                sample.sample_id, sample.num_turns, sample.turn_versions = sample_id, len(versions), versions
                done.append(sample)
        return done

    def finalize_if_drained(self):
        return not self.live

    def abort(self):
        self._suspended, self.live = dict(self.live), {}
        return []

    def suspended(self):
        return list(self._suspended)


def run_turn_loop(max_turn_staleness, steps=16, pattern=(1, 3, 1, 6)):
    """``steps`` steps with a sync after each (carry): short groups train at once, the 3- and 6-turn
    ones are interrupted by every sync and resumed under the new weights."""
    prompts = [
        [{"prompt": f"{b}-{i}", "turns": pattern[b % len(pattern)]} for i in range(2)] for b in range(40)
    ]
    coordinator = TurnCoordinator()
    controller = AgenticRolloutController(coordinator, group_size=2, tail_policy="carry")
    loop = AgenticRolloutLoop(
        prompts,
        controller,
        coordinator,
        collate=lambda groups: SimpleNamespace(groups=groups, stats={}),
        num_generations=2,
        max_staleness=1,
        max_inflight=2,
        max_turn_staleness=max_turn_staleness,
        poll_interval_s=0.0,
    )
    batches_ = []
    for _ in range(steps):
        batch = loop.next_batch()
        batch.version = controller.weight_version
        batches_.append(batch)
        controller.quiesce()
        controller.sync_weights(lambda version: setattr(coordinator, "version", version))
    return loop, batches_


def test_max_turn_staleness_evicts_groups_with_a_turn_older_than_the_bound_and_counts_them():
    loop, batches_ = run_turn_loop(max_turn_staleness=2)
    for batch in batches_:
        staleness = [batch.version - min(s.turn_versions) for group in batch.groups for s in group]
        assert max(staleness) <= 2, "a trained episode had a turn older than max_turn_staleness"
        assert batch.stats["agentic/turn_staleness_max"] == max(staleness)
        assert batch.stats["agentic/turn_staleness_mean"] == pytest.approx(sum(staleness) / len(staleness))
    trained = [s for batch in batches_ for group in batch.groups for s in group]
    assert any(len(set(s.turn_versions)) > 1 for s in trained), (
        "carried episodes within the bound still train"
    )
    assert loop.turn_evicted_groups > 0 and len(loop.turn_evicted_roots) == loop.turn_evicted_groups
    assert batches_[-1].stats["agentic/turn_evicted_groups"] == loop.turn_evicted_groups
    assert set(loop.turn_evicted_roots) <= set(loop.evicted_roots)
    assert not set(loop.turn_evicted_roots) & set(loop.trained_roots)
    submitted = {f"g{i}" for i in range(loop.next_root)}
    outcomes = [set(loop.trained_roots), set(loop.evicted_roots), set(loop.dropped_roots), set(loop.pending)]
    assert set().union(*outcomes) == submitted and sum(map(len, outcomes)) == len(submitted)
    assert all(len(batch.groups) == 2 for batch in batches_), "evictions must not shrink a batch"
    assert loop.loop_state()["turn_evicted_groups"] == loop.turn_evicted_groups


def test_without_max_turn_staleness_nothing_changes_and_the_turn_staleness_is_still_logged():
    loop, batches_ = run_turn_loop(max_turn_staleness=None)
    loose, loose_batches = run_turn_loop(max_turn_staleness=100)
    assert list(loop.trained_roots) == list(loose.trained_roots)

    def counts(batch):  # every figure but the timings
        return {key: value for key, value in batch.stats.items() if not key.startswith("perf/")}

    assert [counts(b) for b in batches_] == [counts(b) for b in loose_batches]
    assert loop.turn_evicted_groups == 0 and not loop.turn_evicted_roots
    assert max(b.stats["agentic/turn_staleness_max"] for b in batches_) > 2  # what the bound would have cut
    assert all(b.stats["agentic/turn_evicted_groups"] == 0 for b in batches_)


# --- the settings on the module's rollout spec ----------------------------------------------------


def test_the_agentic_module_carries_the_new_settings_on_its_rollout_spec_and_checks_them():
    from unirl_lightning.envs.coordinator import EpisodeSettings
    from unirl_lightning.models.causal_lm import TinyCausalLM
    from unirl_lightning.modules import AgenticGRPOModule

    env = "unirl_lightning.envs:GuessingGameEnv"
    policy = TinyCausalLM(hidden_size=8, num_layers=1, num_heads=1, intermediate_size=8)
    default = AgenticGRPOModule(env=env, policy=policy).rollout_spec().agentic
    assert (default.max_turn_staleness, default.truncated_turn, default.max_context_tokens) == (
        None,
        "close",
        None,
    )
    module = AgenticGRPOModule(
        env=env, policy=policy, max_turn_staleness=0, truncated_turn="end", max_context_tokens=256
    )
    spec = module.rollout_spec().agentic
    assert (spec.max_turn_staleness, spec.truncated_turn, spec.max_context_tokens) == (0, "end", 256)
    assert spec.episode_settings() == EpisodeSettings("raise", "end", 256)
    for key, value, message in [
        ("max_turn_staleness", -1, "max_turn_staleness must be >= 0, got -1"),
        ("truncated_turn", "trim", r"truncated_turn must be one of \('close', 'end'\), got 'trim'"),
        ("max_context_tokens", 0, "max_context_tokens must be >= 1, got 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            AgenticGRPOModule(env=env, policy=policy, **{key: value})
