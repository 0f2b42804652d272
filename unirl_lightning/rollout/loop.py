"""RolloutLoop: the training *policy* that turns a prompt stream into ExperienceBatches.

Installed by :class:`~unirl_lightning.strategy.AsyncRolloutStrategy` in place of the training
dataloader, so Lightning's fit loop iterates it like any dataloader. Each ``next()`` is one RL step:

* autoregressive (``order="launch_first"``): top up the in-flight window to the launch ceiling,
  then poll, then drain the freshest ``groups_per_step`` groups; wait on the oldest job while the
  buffer is short.
* diffusion (``order="poll_first"``): poll first, so a ready result is reaped before any new launch
  (a launch must never block the transfer of a finished result), then top up, then drain; after a
  wait on the oldest job it polls again before topping up. With one request in flight this launches
  the next request as soon as the previous result is reaped, so it generates while this step trains.

The staleness contract: a group launched under weight version ``v`` is trained only while
``current_version - v <= max_staleness``; older groups are evicted, counted and logged, never
trained. Draining is freshest-first: when generation outpaces training the buffer holds more than
one step, the freshest groups are trained and the older ones may age out (counted in
``rollout/evicted_groups``); when generation is the bottleneck the buffer rarely holds more than
one step, so nothing ages out. Eviction therefore only spends generation that had slack. ``launch_ceiling`` keeps launches from running so far ahead that they would be evicted.
The loop's position (prompts handed out, launched-but-untrained requests, next gen_id, version)
is in ``loop_state()`` so that a checkpoint resumes without losing or repeating prompts. A resumed
loop relaunches the untrained requests first, under new gen_ids; those gen_ids do not count
against the launch ceiling's look-ahead (``gen_id_offset``), so a resumed run keeps as many
requests in flight as before the restart.

Dynamic sampling (``filter_groups``, DAPO): a group whose rewards are all equal carries no
group-relative signal, so the loop's ``complete`` hook drops it before it reaches the buffer (counted,
cumulative, in ``rollout/filtered_groups``) and the step keeps launching until ``groups_per_step``
groups are buffered. The launch ceiling assumes request ``g`` is trained at step ``g``, so at
``max_staleness=0`` it leaves no request to spare: when everything the ceiling allows has been
reaped and the buffer is still short, the loop launches a *replacement* request beyond the ceiling.
It is launched within the step, before the step's weight sync, so it carries the current version
and is trained under it: staleness stays within the bound (eviction still enforces it). Like a
resume's relaunches, a replacement's gen_id is added to ``gen_id_offset``, so it does not use up the
look-ahead of later steps. At most ``max_filter_launches_per_step`` replacements are launched per
step (logged in ``rollout/filter_launches``); a step that would need more raises ``RuntimeError``
instead of training a short batch (the data gives almost no reward signal; a short batch would
change the step's size silently).

The loop trusts its arguments: the strategy validates them (one layer of validation).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Literal

from unirl_lightning.rollout.controller import (
    BatchRolloutController,
    StampedGroup,
    admit_groups,
    launch_ceiling,
)
from unirl_lightning.rollout.occupancy import OccupancyMeter
from unirl_lightning.rollout.records import GenerationResult
from unirl_lightning.rollout.step_stats import (  # re-exported: callers import them from here too
    reward_part_means,
    step_stats,
    token_version_stats,
    zero_variance,
)
from unirl_lightning.rollout.stream import PromptStream

RolloutOrder = Literal["launch_first", "poll_first"]

Collate = Callable[[list[list[Any]]], Any]
"""``collate(groups) -> batch``: the module's batch type, with its own ``stats`` filled in."""


class DeferredBatch:
    """What the loop yields to Lightning: resolved into the real batch by the strategy."""

    __slots__ = ("loop",)

    def __init__(self, loop: RolloutLoop) -> None:
        self.loop = loop

    def resolve(self) -> Any:
        return self.loop.next_batch()


class RolloutLoop:
    """Turns a stream of prompt batches into trained batches, one RL step per ``next_batch()``.

    Args:
        prompts: an iterable of prompt-record batches (the datamodule's train dataloader); it is
            iterated again when exhausted; its length (batches per pass) is a Lightning epoch.
        controller: the mechanism (launch, poll, drain, version ledger).
        collate: ``collate(groups) -> batch`` of the module's batch type.
        build_request: ``build_request(records, gen_id) -> request`` (the module's sampling).
        max_staleness / max_inflight / sync_interval: the staleness contract (see the module docstring).
        order: ``"launch_first"`` (autoregressive) or ``"poll_first"`` (diffusion).
        extra_stats: more per-step figures for the batch's ``stats`` (e.g. worker restarts).
        filter_groups: drop zero-variance groups and launch replacements (see the module docstring).
        max_filter_launches_per_step: the most replacement requests one step may launch.
        clock: the monotonic clock the loop measures waits with (``time.perf_counter``; a simulator
            passes its discrete clock).
        wall_clock: the clock of the timeline's span ends (``time.time``).
        launch_unit: ``"request"`` (a launch is one step's prompt batch) or ``"group"`` (a launch is one
            prompt: its group is reaped when it finishes; the ceiling is :func:`admit_groups`, and
            ``max_inflight`` steps' worth of groups may be in flight).
    """

    def __init__(
        self,
        prompts: Iterable[list[dict[str, Any]]],
        controller: BatchRolloutController,
        *,
        collate: Collate,
        build_request: Callable[[list[dict[str, Any]], int], Any],
        max_staleness: int,
        max_inflight: int,
        sync_interval: int,
        order: RolloutOrder = "launch_first",
        num_rollouts: int | None = None,
        extra_stats: Callable[[], dict[str, float]] | None = None,
        filter_groups: bool = False,
        max_filter_launches_per_step: int = 10,
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] = time.time,
        launch_unit: Literal["request", "group"] = "request",
    ) -> None:
        self.launch_unit = launch_unit
        self.pending_records: list[dict[str, Any]] = []  # group launches: the rest of the batch drawn
        self.clock = clock
        self.wall_clock = wall_clock
        self.prompts = prompts
        self.controller = controller
        if controller is not None:  # the loop stamps and records what it launched
            controller.complete_with(self.complete)
        self.collate = collate
        self.build_request = build_request
        self.max_staleness = max_staleness
        self.max_inflight = max_inflight
        self.sync_interval = sync_interval
        self.order = order
        self.num_rollouts = num_rollouts
        self.extra_stats = extra_stats
        self.filter_groups = filter_groups
        self.max_filter_launches_per_step = max_filter_launches_per_step
        self.filtered_groups = 0  # zero-variance groups dropped so far (filter_groups)
        self.recent_filtered_gen_ids: deque[int] = deque(maxlen=1024)  # requests with every group dropped
        self.filter_launches = 0  # replacement requests launched in the current step
        # position in the prompt stream and the requests launched but not yet trained
        self.steps = 0
        self.stream = PromptStream(prompts)
        self.gen_id_offset = 0  # gen_ids used by relaunches after a resume (not counted by the ceiling)
        self.untrained: dict[int, list[dict[str, Any]]] = {}  # gen_id -> prompt records
        self.evicted_groups = 0
        self.interrupt_dropped = (
            0  # suspended requests dropped as over-stale at resume (sync_mode="interrupt")
        )
        self.resume_dropped_partials = 0  # partial samples a checkpoint resume relaunched from the prompt
        self.recent_evicted_gen_ids: deque[int] = deque(maxlen=1024)  # for inspection; bounded
        self.blocked_s = 0.0  # time the trainer waited on generation since the last batch
        self.generate_s = 0.0  # generation time of the jobs reaped since the last batch
        self.score_s = 0.0  # reward time of the jobs reaped since the last batch
        self.reward_timeouts = 0  # reward checks given up on since the start or resume
        self.groups_per_step: int | None = None
        self.occupancy = OccupancyMeter()  # the engines' active rows / slots (rollout/engine_occupancy)
        # an optional span recorder (``unirl_lightning.core.timeline.Timeline``: ``span(name, start, end,
        # **args)``), set by the runtime; None records nothing
        self.timeline: Any = None

    def _build(self, gen_id: int) -> Any:
        if self.launch_unit == "group":
            records = [self._next_record()]
        else:
            records = self.stream.next_records()
            if self.groups_per_step is None:
                self.groups_per_step = len(records)
        self.untrained[gen_id] = records
        return self.build_request(records, gen_id)

    def _next_record(self) -> dict[str, Any]:
        """Group launches: the next prompt, drawn from the stream one batch at a time (a relaunch after a
        resume is a batch of one)."""
        if not self.pending_records:
            self.pending_records = self.stream.next_records()
            if self.groups_per_step is None:
                self.groups_per_step = len(self.pending_records)
        return self.pending_records.pop(0)

    # -- one step -------------------------------------------------------------------------------
    def __iter__(self) -> RolloutLoop:
        return self

    def __len__(self) -> int:
        """One Lightning epoch is one pass over the training prompts (``max_epochs``, ``current_epoch``,
        ``on_train_epoch_end`` and the monitors checked there follow it); the loop itself runs on across
        epochs, with what is in flight and buffered."""
        return self.stream.batches_per_pass()

    def __next__(self) -> DeferredBatch:
        """A placeholder the strategy turns into the real batch (:meth:`next_batch`) at ``batch_to_device``.

        Lightning's fit loop fetches one batch ahead of the step it runs. Draining then would
        judge staleness (and launch) under the weight version *before* the previous step's sync,
        which breaks ``max_staleness=0``; deferring the step to ``batch_to_device`` runs it after
        that sync, right before ``training_step``.
        """
        return DeferredBatch(self)

    def launch_limit(self) -> int:
        """The exclusive gen_id bound for launches now (the launch ceiling, shifted by relaunches)."""
        if self.launch_unit == "group":
            if self.groups_per_step is None:  # the step's size comes from the first prompt batch
                self.pending_records = self.stream.next_records()
                self.groups_per_step = len(self.pending_records)
            ctl = self.controller
            return ctl.next_gen_id + self._admissible(ctl.inflight, self.max_inflight * self.groups_per_step)
        ceiling = launch_ceiling(
            self.steps, self.sync_interval, self.max_staleness, self.num_rollouts or 1 << 62
        )
        return ceiling + self.gen_id_offset

    def next_batch(self) -> Any:
        """Run one RL step of the rollout policy and return the batch to train on."""
        ctl = self.controller
        limit = self.launch_limit()
        self.filter_launches = 0
        while True:
            if self.launch_unit == "group":  # groups in flight change within the step: admit again
                limit = self.launch_limit()
            if self.order == "poll_first":  # reap what is ready (also after a wait) before any launch
                self._reap()
            ctl.launch_until(limit, self._inflight_cap(), self._build)
            if self.order == "launch_first":
                self._reap()
            if self.filter_groups and self._short():
                if ctl.next_gen_id >= limit:  # the ceiling is used up: one replacement request
                    self._allow_replacement()
                    limit += 1
                continue
            drained = ctl.drain_freshest(self.groups_per_step or 1, self.max_staleness)
            self._count_evicted()
            if drained is not None:
                break
            start = self.clock()
            ctl.wait_any() if self.launch_unit == "group" else ctl.wait_oldest()
            self._blocked(self.clock() - start, "oldest")
        return self._make_batch(drained)

    def _window_headroom(self) -> dict[str, float]:
        """Group launches: ``{"rollout/window_headroom": groups}``, what the staleness window would still
        admit beyond the groups launched when the step's batch is taken (0: the window is what holds
        launches back, and a starved engine waits on it; above 0: ``max_inflight`` or the prompts do)."""
        if self.launch_unit != "group" or self.groups_per_step is None:
            return {}
        return {"rollout/window_headroom": float(self._admissible(0, 1 << 62, bounded=False))}

    def _admissible(self, inflight: int, max_inflight: int, bounded: bool = True) -> int:
        """:func:`admit_groups` for this loop's contract and launches so far (``bounded``: within the
        run's ``num_rollouts`` steps of groups)."""
        assert self.groups_per_step is not None
        total = None if self.num_rollouts is None or not bounded else self.num_rollouts * self.groups_per_step
        return admit_groups(
            trained_steps=self.steps,
            sync_interval=self.sync_interval,
            max_staleness=self.max_staleness,
            groups_per_step=self.groups_per_step,
            launched=self.controller.next_gen_id - self.gen_id_offset,
            inflight=inflight,
            max_inflight=max_inflight,
            num_groups=total,
        )

    def _inflight_cap(self) -> int:
        """Jobs in flight at most: ``max_inflight`` requests, or as many steps' worth of groups."""
        if self.launch_unit == "group":
            return self.max_inflight * (self.groups_per_step or 1)
        return self.max_inflight

    def _short(self) -> bool:
        """True when nothing is in flight and fewer trainable groups are buffered than a step needs
        (only possible when groups were filtered): ``drain_freshest`` would raise."""
        ctl = self.controller
        if ctl.inflight:
            return False
        ctl.evict_stale(self.max_staleness)
        self._count_evicted()
        return ctl.buffered < (self.groups_per_step or 1)

    def _allow_replacement(self) -> None:
        """Count one replacement request against the step's budget and take its gen_id out of the
        ceiling's look-ahead; raise once the budget is spent."""
        if self.filter_launches >= self.max_filter_launches_per_step:
            raise RuntimeError(
                f"filter_groups: step {self.steps} still has {self.controller.buffered} of "
                f"{self.groups_per_step} groups with a non-zero reward variance after "
                f"{self.filter_launches} replacement request(s) (max_filter_launches_per_step="
                f"{self.max_filter_launches_per_step}; {self.filtered_groups} zero-variance groups dropped "
                f"so far): the rewards barely vary on this data (too easy or too hard for the policy); "
                f"raise max_filter_launches_per_step, make the task harder or easier, or turn filter_groups off"
            )
        self.filter_launches += 1
        self.gen_id_offset += 1

    def _reap(self) -> None:
        start = self.clock()
        self.controller.poll()
        self._blocked(self.clock() - start, "poll")  # result transfer is not hidden either

    def _blocked(self, seconds: float, what: str) -> None:
        """Count ``seconds`` the trainer waited on generation; the timeline gets a ``wait`` span (a
        poll only when it took more than a millisecond: most take microseconds)."""
        self.blocked_s += seconds
        if self.timeline is not None and (what == "oldest" or seconds > 1e-3):
            end = self.wall_clock()
            self.timeline.span("wait", end - seconds, end, cat="train", on=what)

    def _count_evicted(self) -> None:
        for item in self.controller.pop_evicted():
            self.evicted_groups += 1
            self.recent_evicted_gen_ids.append(item.gen_id)
            self.untrained.pop(item.gen_id, None)
        for gen_id, _ in self.controller.pop_dropped():  # a whole request, never to be trained
            self.interrupt_dropped += 1
            self.untrained.pop(gen_id, None)

    def complete(self, gen_id: int, weight_version: int, result: GenerationResult) -> list[Any]:
        """The controller's ``complete`` hook: stamp every sample with the launch-time version."""
        for group in result.groups:
            for rollout in group:
                rollout.gen_id = gen_id
                rollout.weight_version = weight_version
        groups = result.groups
        if self.filter_groups:
            kept = [group for group in groups if not zero_variance(group)]
            self.filtered_groups += len(groups) - len(kept)
            if groups and not kept:  # nothing of this request will be trained or replayed
                self.untrained.pop(gen_id, None)
                self.recent_filtered_gen_ids.append(gen_id)
            groups = kept
        self.generate_s += result.generate_s
        self.score_s += result.score_s
        self.reward_timeouts += result.reward_timeouts
        self.occupancy.observe_spans(result.spans)
        if self.timeline is not None:
            for span in result.spans:
                self.timeline.span(
                    "generate (interrupted)" if span.get("interrupted") else "generate",
                    span["start"],
                    span["end"],
                    cat="rollout",
                    worker=span["worker"],
                    gen_id=gen_id,
                    weight_version=weight_version,
                    samples=span["samples"],
                    completion_tokens=span["completion_tokens"],
                    **({"chunk": span["chunk"]} if "chunk" in span else {}),
                )
        return groups

    def _make_batch(self, drained: list[StampedGroup]) -> Any:
        for item in drained:
            self.untrained.pop(item.gen_id, None)
        groups = [item.group for item in drained]
        batch = self.collate(groups)
        rewards = [[r.reward for r in group] for group in groups]
        batch.stats.update(
            {
                **step_stats(rewards, self.evicted_groups, self.blocked_s, self.generate_s),
                **reward_part_means([r for group in groups for r in group]),
                "rollout/inflight": float(self.controller.inflight),
                **self._window_headroom(),
                **self.occupancy.stats(),
                **token_version_stats(groups, self.controller.weight_version, self.max_staleness),
                **(
                    {
                        "rollout/interrupted_jobs": float(self.controller.interrupted_jobs),
                        "rollout/interrupt_dropped": float(self.interrupt_dropped),
                        "rollout/resume_dropped_partials": float(self.resume_dropped_partials),
                    }
                    if self.controller.interrupted_jobs or self.resume_dropped_partials
                    else {}
                ),
                "perf/score_time_s": self.score_s,
                **({"rollout/reward_timeouts": float(self.reward_timeouts)} if self.reward_timeouts else {}),
                **(
                    {
                        "rollout/filtered_groups": float(self.filtered_groups),
                        "rollout/filter_launches": float(self.filter_launches),
                    }
                    if self.filter_groups
                    else {}
                ),
                **(self.extra_stats() if self.extra_stats else {}),
            }
        )
        self.steps += 1
        self.blocked_s = self.generate_s = self.score_s = 0.0
        return batch

    # -- checkpointing --------------------------------------------------------------------------
    # Not ``state_dict``/``load_state_dict``: Lightning would treat the loop as a stateful dataloader,
    # save rank 0's position with its own loop state and load it on every rank. The strategy saves
    # every rank's position itself.
    def loop_state(self) -> dict[str, Any]:
        """Plain Python types only. Launched-but-untrained prompts are saved by value: a resume
        relaunches them first."""
        replay = self.stream.replay
        return {
            "steps": self.steps,
            **self.stream.position(),
            "next_gen_id": self.controller.next_gen_id,
            "weight_version": self.controller.weight_version,
            "gen_id_offset": self.gen_id_offset - len(replay),  # a load counts pending relaunches again
            "untrained": [self.untrained[g] for g in sorted(self.untrained)] + list(replay),
            "evicted_groups": self.evicted_groups,
            "filtered_groups": self.filtered_groups,
            "interrupt_dropped": self.interrupt_dropped,
            # sync_mode="interrupt": the partial samples in flight are not saved; a resume relaunches
            # their requests from the prompt (in "untrained") and counts the partials it dropped
            "resume_dropped_partials": self.resume_dropped_partials + self.controller.partial_samples(),
            # group launches: the prompts of the batch drawn but not launched yet, and the step's size
            "pending_records": list(self.pending_records),
            "groups_per_step": self.groups_per_step,
        }

    def load_loop_state(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]
        self.stream.restore(state, state["untrained"])
        # each relaunch takes a new gen_id; without the offset they would use up the look-ahead
        self.gen_id_offset = state.get("gen_id_offset", 0) + len(self.stream.replay)
        self.evicted_groups = state["evicted_groups"]
        self.filtered_groups = state.get("filtered_groups", 0)
        self.interrupt_dropped = state.get("interrupt_dropped", 0)
        self.resume_dropped_partials = state.get("resume_dropped_partials", 0)
        self.pending_records = list(state.get("pending_records", []))
        if state.get("groups_per_step") is not None:
            self.groups_per_step = state["groups_per_step"]
