"""AgenticRolloutLoop: the training *policy* of agentic (multi-turn) RL, as visible statement order.

Installed by :class:`~unirl_lightning.strategy.AsyncRolloutStrategy` in place of the training
dataloader when the module's :class:`~unirl_lightning.modules.base.RolloutSpec` has an ``agentic``
part (an :class:`AgenticSpec`). Each ``next()`` is one RL step over the
:class:`~unirl_lightning.rollout.agentic.AgenticRolloutController` (mechanism: one drive at a time,
sibling groups stamped with the weight version current at their *completion*, freshest-first
draining) and the coordinator it drives (inside the rollout workers):

1. **refill**: when no drive is live (the last one drained, or a weight sync quiesced it), submit
   the next drive: new prompt groups first, then, with ``tail_policy="carry"``, the episodes the
   quiesce suspended mid-way (they resume where they stopped, under the new weights).
2. **poll**: ingest the episodes that finished; a group completes with its last sibling.
3. **drain freshest**: take ``groups_per_step`` groups, freshest first, evicting those older than
   ``max_staleness`` versions (counted, never trained). A group with an episode whose environment
   crashed (``on_env_error="drop"``) is counted and never trained.
4. **finalize**: once the drive has produced and handed over everything, end it, so the next pass
   refills; otherwise wait ``poll_interval_s`` and poll again.

How much a drive holds: the new groups bring ``buffered + carried tail + new`` to at least
``groups_per_step * steps_ahead`` groups, ``steps_ahead = max_inflight`` (``1`` when
``max_staleness=0``: synchronous on-policy), and at least one prompt batch. The drive keeps
generating while the trainer trains on the groups already drained (the overlap); the next weight
sync aborts it at a turn boundary (``strategy.sync_weights`` -> ``controller.quiesce()``), so a
turn never straddles two versions and every group completed before the sync keeps the pre-sync
stamp.

Tail policy (``AgenticSpec.tail_policy``), applied to every group a quiesce interrupted (some
episode suspended; the controller keeps or drops those with a sibling already arrived, the loop
those with none): ``"carry"`` resubmits their suspended episodes in the next drive (they finish
later, their turns' versions in ``turn_versions``; the group is stamped when its last sibling
completes; counted in ``agentic/carried`` per interruption); ``"drop"`` discards the groups
(``agentic/dropped``; their finished siblings in ``agentic/dropped_samples``), and none of their
episodes reaches training.

Accounting (``pending`` / ``trained_roots`` / ``evicted_roots`` / ``dropped_roots`` /
``failed_roots``): every group submitted is trained once, evicted, dropped, failed, or still
pending; a tail that does not match the coordinator's suspended episodes raises ``RuntimeError``
(an episode would otherwise be lost silently).

The loop trusts its arguments: the strategy validates them (one layer of validation).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from unirl_lightning.envs.coordinator import EpisodeRequest, OnEnvError
from unirl_lightning.rollout.agentic import AgenticCoordinator, AgenticRolloutController, TailPolicy, root_of
from unirl_lightning.rollout.controller import StampedGroup
from unirl_lightning.rollout.loop import Collate, PendingBatch, PromptStream

__all__ = ["AgenticRolloutLoop", "AgenticSpec", "SuspendingCoordinator"]

_RECENT = 4096  # how many trained / evicted / dropped / failed roots are kept for inspection


@dataclass(frozen=True)
class AgenticSpec:
    """The agentic part of a module's rollout spec (``RolloutSpec.agentic``).

    Attributes:
        env: the :class:`~unirl_lightning.envs.spec.EnvSpec` every episode builds its environment from.
        tail_policy: ``"carry"`` or ``"drop"`` (see the module docstring).
        on_env_error: ``"raise"`` (stop the run with the :class:`~unirl_lightning.envs.EnvStepError`)
            or ``"drop"`` (fail that episode's group, count it in ``agentic/env_errors``, go on).
    """

    env: Any
    tail_policy: TailPolicy = "carry"
    on_env_error: OnEnvError = "raise"


class SuspendingCoordinator(AgenticCoordinator, Protocol):
    """The coordinator contract of :mod:`~unirl_lightning.rollout.agentic`, plus ``suspended()``: the
    sample ids of the episodes the last ``abort`` stopped mid-way (empty after a ``submit``). A
    ``submit`` resumes the suspended episodes it names and discards the others."""

    def suspended(self) -> list[str]: ...


class AgenticRolloutLoop:
    """Turns a stream of prompt batches into trained batches of multi-turn episodes, one RL step per ``next_batch()``.

    Args:
        prompts: an iterable of prompt-record batches (the datamodule's train dataloader), iterated
            again when exhausted; its batch size is ``groups_per_step``.
        controller: the agentic controller (one drive at a time, completion-time stamps, tail policy).
        coordinator: the coordinator the controller drives (for ``suspended()``).
        collate: ``collate(groups) -> batch`` of the module's batch type.
        num_generations: episodes per prompt (the group size).
        max_staleness / max_inflight: the staleness contract (see the module docstring).
        seed: base seed of the episodes (sibling ``k`` of group ``g``: ``seed + g * n + k``).
        poll_interval_s: wait between polls while a step waits for groups.
        stall_timeout_s: a step that sees no group complete for this long raises ``TimeoutError``
            (an environment step or a generation call hangs); None = wait forever.
        extra_stats: more per-step figures for the batch's ``stats`` (e.g. worker restarts).
    """

    def __init__(
        self,
        prompts: Iterable[list[dict[str, Any]]],
        controller: AgenticRolloutController,
        coordinator: SuspendingCoordinator,
        *,
        collate: Collate,
        num_generations: int,
        max_staleness: int,
        max_inflight: int,
        seed: int = 0,
        poll_interval_s: float = 0.02,
        stall_timeout_s: float | None = None,
        extra_stats: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        self.prompts = prompts
        self.controller = controller
        self.coordinator = coordinator
        self.collate = collate
        self.num_generations = num_generations
        self.max_staleness = max_staleness
        self.max_inflight = max_inflight
        self.steps_ahead = max_inflight if max_staleness > 0 else 1
        self.seed = seed
        self.poll_interval_s = poll_interval_s
        self.stall_timeout_s = stall_timeout_s
        self.extra_stats = extra_stats
        self.tail_policy = controller.tail_policy
        # position in the prompt stream
        self.steps = 0
        self.stream = PromptStream(prompts)  # untrained records are submitted first after a resume
        self.groups_per_step: int | None = None
        # every group submitted: pending until trained, evicted, dropped or failed
        self.next_root = 0
        self.pending: dict[str, dict[str, Any]] = {}  # root -> its prompt record
        self.trained_roots: deque[str] = deque(maxlen=_RECENT)
        self.evicted_roots: deque[str] = deque(maxlen=_RECENT)
        self.dropped_roots: deque[str] = deque(maxlen=_RECENT)
        self.failed_roots: deque[str] = deque(maxlen=_RECENT)
        self.evicted_groups = 0
        self.recent_evicted_gen_ids: deque[int] = deque(maxlen=_RECENT)
        self.failed_groups = 0
        self.env_errors = 0  # episodes whose environment crashed (on_env_error="drop")
        self.drives = 0
        self.carried = 0  # groups a sync interrupted that were resubmitted (counted per interruption)
        self.dropped = 0  # groups a sync interrupted that were discarded
        self._drive_roots: set[str] = set()  # the groups the last drive was asked for
        self._drive_start_gen_id = controller.next_gen_id  # the controller's counts when it began
        self._dropped_seen = controller.dropped
        self.blocked_s = 0.0  # time the trainer waited on episodes since the last batch
        self._last_progress = time.monotonic()  # when a group last completed (or the step began)

    def _next_records(self) -> list[dict[str, Any]]:
        records = self.stream.next_records()
        if self.groups_per_step is None:
            self.groups_per_step = len(records)
        return records

    # -- one step -----------------------------------------------------------------------------------
    def __iter__(self) -> AgenticRolloutLoop:
        return self

    def __next__(self) -> PendingBatch:
        """A placeholder resolved into the real batch at ``batch_to_device``, after the previous
        step's sync (see :meth:`RolloutLoop.__next__ <unirl_lightning.rollout.loop.RolloutLoop.__next__>`)."""
        return PendingBatch(self)

    def next_batch(self) -> Any:
        """Run one RL step of the agentic rollout policy and return the batch to train on."""
        ctl = self.controller
        self._last_progress = time.monotonic()
        while True:
            if not ctl.drive_live:  # the last drive drained, or a sync quiesced it: refill
                self._submit()
            self._poll()  # finished episodes in; a group completes with its last sibling
            drained = ctl.drain_freshest(self.groups_per_step, self.max_staleness)  # None while short
            self._count_evicted()
            if drained is not None:
                groups = self._trainable(drained)  # groups with a crashed environment: counted, not trained
                if groups:
                    return self._make_batch(groups)
                continue
            if not ctl.finalize_if_drained():  # True: the drive handed over everything; refill at the top
                self._wait()

    def _submit(self) -> None:
        ctl = self.controller
        stopped = self.coordinator.suspended()  # episodes the last quiesce stopped mid-way: the tail
        tail_roots = {root_of(sample_id) for sample_id in stopped}
        self._check_tail(tail_roots)
        if self.tail_policy == "drop":  # interrupted groups never reach training
            self.dropped += len(tail_roots)
            for root in sorted(tail_roots):
                self.pending.pop(root, None)
                self.dropped_roots.append(root)
        else:  # interrupted groups finish in this drive
            self.carried += len(tail_roots)
        requests: list[EpisodeRequest] = []
        new_groups = 0
        carried = len(tail_roots) if self.tail_policy == "carry" else 0
        while True:  # at least one prompt batch; more until the drive fills the window
            for record in self._next_records():
                requests.extend(self._new_group(record))
                new_groups += 1
            if ctl.buffered + carried + new_groups >= self.groups_per_step * self.steps_ahead:
                break
        if self.tail_policy == "carry":  # resumed where they stopped (after the new groups: the drive's seed)
            requests.extend(self._resumed(sample_id) for sample_id in stopped)
        self.drives += 1
        self._drive_roots = {root_of(request.sample_id) for request in requests}
        ctl.submit(requests)

    def _check_tail(self, tail_roots: set[str]) -> None:
        """Every group of the last drive completed (the controller stamped it: ``next_gen_id`` moved on)
        or has suspended episodes (the tail); the controller kept (carry) or dropped (drop) those of
        the tail with a sibling already arrived, the loop carries or drops the others. Anything else
        would lose an episode silently, so it raises ``RuntimeError``."""
        ctl = self.controller
        completed = ctl.next_gen_id - self._drive_start_gen_id
        kept, dropped = set(ctl.tail_roots()), ctl.dropped - self._dropped_seen
        self._drive_start_gen_id, self._dropped_seen = ctl.next_gen_id, ctl.dropped
        accounted = completed + len(tail_roots) == len(self._drive_roots) and tail_roots <= self._drive_roots
        if self.tail_policy == "carry":
            accounted = accounted and kept <= tail_roots and not dropped
        else:
            accounted = accounted and not kept and dropped <= len(tail_roots)
        if not accounted:
            raise RuntimeError(
                f"the last drive had {len(self._drive_roots)} group(s): {completed} completed and the coordinator "
                f"suspended episodes of {sorted(tail_roots)}, while the controller kept {sorted(kept)} and dropped "
                f"{dropped} incomplete group(s) (tail_policy={self.tail_policy!r}): an episode would be lost or "
                "trained twice"
            )

    def _new_group(self, record: dict[str, Any]) -> list[EpisodeRequest]:
        index, n = self.next_root, self.num_generations
        root = f"g{index}"
        self.next_root += 1
        self.pending[root] = record
        return [EpisodeRequest(f"{root}/{k}", record, self.seed + index * n + k) for k in range(n)]

    def _resumed(self, sample_id: str) -> EpisodeRequest:
        return EpisodeRequest(sample_id, self.pending[root_of(sample_id)])

    def _poll(self) -> None:
        start = time.perf_counter()
        if self.controller.poll():
            self._last_progress = time.monotonic()
        self.blocked_s += time.perf_counter() - start

    def _wait(self) -> None:
        stalled = time.monotonic() - self._last_progress
        if self.stall_timeout_s is not None and stalled > self.stall_timeout_s:
            raise TimeoutError(
                f"no agentic group completed for {stalled:.0f} s (stall_timeout_s={self.stall_timeout_s:.0f}, "
                f"the strategy's generation_timeout_s) with {self.controller.pending_groups} group(s) partly "
                "done: an environment step or a generation call seems to hang"
            )
        time.sleep(self.poll_interval_s)
        self.blocked_s += self.poll_interval_s

    def _count_evicted(self) -> None:
        for item in self.controller.pop_evicted():
            root = root_of(item.group[0].sample_id)
            self.pending.pop(root, None)
            self.evicted_roots.append(root)
            self.evicted_groups += 1
            self.recent_evicted_gen_ids.append(item.gen_id)

    def _trainable(self, drained: list[StampedGroup]) -> list[list[Any]]:
        """Stamp the drained groups' samples (completion-time version, gen_id); set aside failed ones."""
        groups = []
        for item in drained:
            root = root_of(item.group[0].sample_id)
            self.pending.pop(root, None)
            failed = sum(sample.env_error is not None for sample in item.group)
            if failed:
                self.env_errors += failed
                self.failed_groups += 1
                self.failed_roots.append(root)
                continue
            for sample in item.group:
                sample.gen_id = item.gen_id
                sample.weight_version = item.weight_version
            self.trained_roots.append(root)
            groups.append(item.group)
        return groups

    def _make_batch(self, groups: list[list[Any]]) -> Any:
        ctl = self.controller
        batch = self.collate(groups)
        samples = [sample for group in groups for sample in group]
        count = len(samples)
        rewards = [[sample.reward for sample in group] for group in groups]
        flat = [reward for group in rewards for reward in group]
        mean = sum(flat) / count
        generate_s = sum(sample.generate_s for sample in samples)
        overlap = 1.0 - min(1.0, self.blocked_s / generate_s) if generate_s > 0 else 0.0
        batch.stats.update(
            {
                "rollout/reward_mean": mean,
                "rollout/reward_std": (sum((x - mean) ** 2 for x in flat) / max(1, count - 1)) ** 0.5,
                "rollout/zero_variance_groups": sum(len(set(g)) == 1 for g in rewards) / len(rewards),
                "rollout/evicted_groups": float(self.evicted_groups),
                "rollout/buffered_groups": float(ctl.buffered),
                "rollout/pending_groups": float(ctl.pending_groups),
                "agentic/carried": float(self.carried),
                "agentic/dropped": float(self.dropped),
                "agentic/dropped_samples": float(ctl.dropped_samples),
                "agentic/env_errors": float(self.env_errors),
                "agentic/failed_groups": float(self.failed_groups),
                "agentic/turns_mean": sum(s.num_turns for s in samples) / count,
                "agentic/turns_max": float(max(s.num_turns for s in samples)),
                "agentic/tool_calls_mean": sum(s.tool_calls for s in samples) / count,
                "agentic/episode_len_mean": sum(len(s.completion_ids) for s in samples) / count,
                "agentic/episode_len_max": float(max(len(s.completion_ids) for s in samples)),
                "agentic/model_tokens_mean": sum(sum(s.loss_mask) for s in samples) / count,
                "agentic/truncated_fraction": sum(s.truncated for s in samples) / count,
                "agentic/multi_version_fraction": sum(len(set(s.turn_versions)) > 1 for s in samples) / count,
                "agentic/drives": float(self.drives),
                "perf/generate_time_s": generate_s,
                "perf/wait_time_s": self.blocked_s,
                "perf/overlap": overlap,
                **(self.extra_stats() if self.extra_stats else {}),
            }
        )
        self.steps += 1
        self.blocked_s = 0.0
        return batch

    # -- checkpointing ------------------------------------------------------------------------------
    # loop_state, not state_dict: Lightning would take the loop for a stateful dataloader (see RolloutLoop)
    def loop_state(self) -> dict[str, Any]:
        """Plain Python types only. The records of the groups submitted but not yet trained (nor
        evicted, dropped or failed) are saved by value: a resume submits them first, as new groups."""
        return {
            "steps": self.steps,
            **self.stream.position(),
            "next_gen_id": self.controller.next_gen_id,
            "weight_version": self.controller.weight_version,
            "next_root": self.next_root,
            "groups_per_step": self.groups_per_step,
            "untrained": list(self.pending.values()) + [r for batch in self.stream.replay for r in batch],
            "evicted_groups": self.evicted_groups,
            "failed_groups": self.failed_groups,
            "env_errors": self.env_errors,
        }

    def load_loop_state(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]
        self.next_root = state["next_root"]
        self.groups_per_step = state["groups_per_step"]
        size = self.groups_per_step or 1
        untrained = list(state["untrained"])
        self.stream.restore(state, [untrained[i : i + size] for i in range(0, len(untrained), size)])
        self.evicted_groups = state["evicted_groups"]
        self.failed_groups = state["failed_groups"]
        self.env_errors = state["env_errors"]
