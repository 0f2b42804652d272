"""``launch_unit="group"`` under random schedules, with a kill and a resume: the real loop and controller,
one fake job per prompt finishing after a random number of polls (no Ray, no model).

The contracts, at group granularity: every trained row within ``max_staleness`` of the weights it is
trained against; ``batch_size`` groups a step; no prompt trained twice, across the resume too; and
nothing drawn is lost: the prompts trained, evicted (counted), launched-but-untrained or drawn and not
yet launched form an unbroken prefix of the prompt stream."""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fakes import FakeGenerationHandle
from tests.unit.test_loop import build_request, fake_generate
from unirl_lightning.rollout.batches import ExperienceBatch
from unirl_lightning.rollout.controller import BatchRolloutController
from unirl_lightning.rollout.loop import RolloutLoop

BATCH = 3  # prompts (groups) per step


def stream(passes: int = 1) -> list[list[dict]]:
    """Batches of unique prompts, in order: ``p0, p1, ...``."""
    prompts = [{"prompt": f"p{i}", "answer": "x"} for i in range(60 * passes)]
    return [prompts[i : i + BATCH] for i in range(0, len(prompts), BATCH)]


class Run:
    """One process's loop and controller; ``launches`` maps every gen_id to its prompt."""

    def __init__(self, delays, launches, state=None, fail_gen_id=None, **contract):
        def launch(request):
            assert len(request.records) == 1, "a group launch carries one prompt"
            launches[request.gen_id] = request.records[0]["prompt"]
            delay = delays[request.gen_id % len(delays)]
            handle = FakeGenerationHandle(fake_generate(request).value, delay=delay)
            if request.gen_id == fail_gen_id:  # e.g. a reward raising for this group
                handle.failures_left = 1
            return handle

        state = state or {}
        self.ctl = BatchRolloutController(  # as the runtime builds it from a checkpoint
            launch,
            start_gen_id=state.get("next_gen_id", 0),
            start_weight_version=state.get("weight_version", 0),
        )
        self.loop = RolloutLoop(
            stream(),
            self.ctl,
            collate=functools.partial(ExperienceBatch.collate, pad_token_id=0),
            build_request=build_request,
            launch_unit="group",
            **contract,
        )
        if state:
            self.loop.load_loop_state(state)

    def save(self) -> dict:
        """What a checkpoint keeps (``ModelCheckpoint`` every step)."""
        self.saved = {**self.loop.loop_state(), "next_gen_id": self.ctl.next_gen_id}
        self.saved["weight_version"] = self.ctl.weight_version
        return self.saved

    def steps(self, n, max_staleness, sync_interval, trained):
        self.save()
        for _ in range(n):
            batch = self.loop.next_batch()
            assert int((self.ctl.weight_version - batch.weight_versions).max()) <= max_staleness
            gen_ids = sorted(set(batch.gen_ids.tolist()))
            assert len(gen_ids) == BATCH, "a step trains batch_size groups"
            # what the window still admits: none once max_inflight covers the whole window
            headroom = batch.stats["rollout/window_headroom"]
            assert headroom >= 0
            if self.loop.max_inflight >= (max_staleness + 1) * sync_interval:
                assert headroom == 0, "max_inflight covers the window: every group it admits is launched"
            trained += gen_ids
            if self.loop.steps % sync_interval == 0:  # WeightSyncCallback's cadence
                self.ctl.quiesce()
                self.ctl.sync_weights(lambda version: None)
            self.save()


@settings(max_examples=60, deadline=None)
@given(
    max_staleness=st.integers(0, 2),
    max_inflight=st.integers(1, 3),
    sync_interval=st.integers(1, 3),
    delays=st.lists(st.integers(0, 4), min_size=7, max_size=13),
    kill_at=st.integers(1, 6),
    fail_gen_id=st.none() | st.integers(0, 20),
)
def test_group_launches_keep_the_bound_and_lose_or_repeat_no_prompt_across_a_resume(
    max_staleness, max_inflight, sync_interval, delays, kill_at, fail_gen_id
):
    """Killed after ``kill_at`` steps, or earlier by a group whose job fails (``fail_gen_id``: the error
    reaches the trainer, which stops); resumed from the last step's state to 8 steps in all."""
    contract = dict(max_staleness=max_staleness, max_inflight=max_inflight, sync_interval=sync_interval)
    launches: dict[int, str] = {}
    trained: list[int] = []
    first = Run(delays, launches, fail_gen_id=fail_gen_id, **contract)
    try:
        first.steps(kill_at, max_staleness, sync_interval, trained)
    except RuntimeError as exc:
        assert str(exc) == "generation failed" and fail_gen_id in launches
        del trained[first.saved["steps"] * BATCH :]  # a step that raised trained nothing
    state = first.saved
    # the kill: everything in flight in the first process is lost with it
    second = Run(delays, launches, state=state, **contract)
    second.steps(8 - state["steps"], max_staleness, sync_interval, trained)

    prompts = [launches[g] for g in trained]
    assert len(prompts) == len(set(prompts)), "a prompt was trained twice"
    loop = second.loop
    evicted = {launches[g] for g in first.loop.recent_evicted_gen_ids} | {
        launches[g] for g in loop.recent_evicted_gen_ids
    }
    assert first.loop.evicted_groups + loop.evicted_groups >= len(evicted)
    # held: what the loop would save for the next resume (launched-but-untrained groups, the relaunches
    # a resume queued and the run ended before, the batch drawn but not launched)
    saved = loop.loop_state()
    held = {r["prompt"] for records in saved["untrained"] for r in records}
    held |= {r["prompt"] for r in saved["pending_records"]}
    drawn = set(prompts) | evicted | held
    reached = max(int(p[1:]) for p in drawn)
    assert drawn == {f"p{i}" for i in range(reached + 1)}, "a prompt drawn before the kill was lost"


def test_a_kill_with_part_of_a_batch_unlaunched_resumes_it():
    """The deterministic case the property test reaches by chance: the inflight cap stops a batch part
    way, the state keeps the unlaunched prompts, and the resumed loop launches them (not skipped)."""
    launches: dict[int, str] = {}
    contract = dict(max_staleness=3, max_inflight=1, sync_interval=1)
    first = Run([0, 5, 0, 0, 3, 0], launches, **contract)
    first.steps(1, 3, 1, [])
    state = first.saved
    assert state["pending_records"], "the inflight cap left part of a drawn batch unlaunched"
    pending = [r["prompt"] for r in state["pending_records"]]
    second = Run([0], launches, state=state, **contract)
    trained: list[int] = []
    second.steps(3, 3, 1, trained)
    assert set(pending) <= {launches[g] for g in trained}


def test_a_max_inflight_below_the_window_is_named_with_the_value_that_covers_it():
    """The same bound as the headroom check above: below ``(max_staleness + 1) x every_n_steps`` the
    in-flight cap, not the window, holds the engines back; the warning names the keys and the fix."""
    from unirl_lightning.core.preflight import inflight_window_warning

    assert inflight_window_warning("group", 1, 2, 1) is None  # the defaults cover the window
    assert inflight_window_warning("request", 1, 1, 4) is None  # request launches: one step a request
    assert inflight_window_warning("group", 0, 1, 3) is None  # max_staleness 0: synchronous, as chosen
    warning = inflight_window_warning("group", 2, 3, 2)
    assert warning == (
        "max_inflight=3 caps the groups in flight at 3 steps' worth, below the 6 the staleness window "
        "admits ((max_staleness=2 + 1) x WeightSyncCallback(every_n_steps=2)): the engines may wait on "
        "max_inflight rather than on the window (rollout/window_headroom above 0); set max_inflight: 6"
    )
