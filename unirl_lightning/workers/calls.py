"""Fault-tolerant calls: one generation request spread over the workers, watched until it is done.

Contract:

* :class:`GenerationCall` is the handle :meth:`RolloutWorkerGroup.generate
  <unirl_lightning.workers.group.RolloutWorkerGroup.generate>` returns at once (the rollout
  controller's :class:`~unirl_lightning.rollout.controller.GenerationHandle`): ``ready()`` polls,
  ``wait()`` blocks, ``result()`` reaps. ``result()`` is retryable: a failure raises and the call stays
  reapable. ``ready()`` never raises for a failure inside a worker (``result()`` does).
* Generation has a deadline: each part of a call must answer within ``generation_timeout_s``
  (scaled by the samples it asks for, the group's ``deadline_s``); a wait logs a line every
  ``log_every_s`` while it lasts.
* Worker faults: a part whose worker died, whose engine died (``engines.base.ENGINE_DEAD_ERRORS``,
  e.g. vLLM's ``EngineDeadError``), or that missed its deadline, is relaunched as it was (same
  records, seed and gen_id, so the same launch-time version stamp) on the replacement the group
  makes (``group.replace``, which counts restarts and fails past ``max_restarts``).
* Reward workers: when the group has a ``reward_pool`` (the strategy's ``reward_workers``), a part
  whose generation finished is handed, by reference, to a reward worker, and is done once the scored
  result is back; a reward worker that dies or misses its deadline (the pool's ``deadline_s``) is
  replaced and the scoring relaunched on the same generation result (nothing is generated again).
* Timeline stamps: ``result().spans`` has one entry per part (``worker``, ``start``, ``end``,
  ``samples``, ``completion_tokens``): the worker's own ``generate`` stamps clamped into the interval
  the driver observed, from the part's (last) launch to when its result was seen
  (:func:`~unirl_lightning.core.timeline.clamp_span`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from unirl_lightning.core.timeline import clamp_span
from unirl_lightning.engines.base import is_engine_dead
from unirl_lightning.rollout.records import GenerationResult, Rollout, RolloutRequest

__all__ = ["CallPart", "GenerationCall", "WorkerSubset", "merge_results"]

log = logging.getLogger(__name__)


def call_every(
    workers: list[Any], who: str, method: str, *args: Any, timeout_s: float | None = 600.0, **kwargs: Any
) -> list[Any]:
    """Call ``method`` on every actor of ``workers`` and wait for all answers (at most ``timeout_s``;
    ``TimeoutError`` naming ``who`` and the method past it)."""
    import ray

    refs = [getattr(w, method).remote(*args, **kwargs) for w in workers]
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        raise TimeoutError(f"{who} did not answer {method}() within {timeout_s} s") from exc


def kill_actors(workers: list[Any]) -> None:
    """Kill every actor of ``workers`` (best effort, at teardown)."""
    import ray

    for worker in workers:
        try:
            ray.kill(worker)
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass


@dataclass
class CallPart:
    """One worker's share of a call: what it was asked, on which actor, since when, with what result."""

    index: int
    request: RolloutRequest
    actor: Any
    ref: Any
    started: float
    done: bool = False
    launched_at: float = 0.0  # wall clock (time.time()) of the last launch, for the timeline
    reaped_at: float = 0.0  # wall clock when its result was seen
    score_ref: Any = None  # the reward worker's call on the generation result (reward_pool only)
    scorer: int = -1  # that reward worker's index
    score_actor: Any = None
    score_started: float = 0.0

    @property
    def samples(self) -> int:
        return len(self.request.records) * self.request.n

    @property
    def final_ref(self) -> Any:
        """What the part answers with: the scored result when a reward worker scores, else the generation's."""
        return self.ref if self.score_ref is None else self.score_ref


class GenerationCall:
    """Non-blocking handle on one request spread over several workers (``ready/wait/result``).

    Watches every part: a part whose worker died, or that is past its deadline, is relaunched on a
    replacement worker (see the module docstring). A part that failed inside the worker (e.g. a
    reward error) counts as done; ``result()`` raises that error, and raises it again if called
    again (retryable).
    """

    def __init__(self, group: Any, parts: list[tuple[int, RolloutRequest]]) -> None:
        self._group = group
        self._parts = [self._launch(index, request) for index, request in parts]
        self._last_log = time.monotonic()

    @property
    def parts(self) -> list[CallPart]:
        """Each worker's share, as last polled (``done``, ``score_ref``)."""
        return self._parts

    def _launch(self, index: int, request: RolloutRequest) -> CallPart:
        actor = self._group.workers[index]
        launched_at = time.time()
        group = getattr(self._group, "generate_group", None)  # a threaded worker's generate threads
        method = actor.generate.options(concurrency_group=group) if group else actor.generate
        return CallPart(
            index, request, actor, method.remote(request), time.monotonic(), launched_at=launched_at
        )

    def _relaunch(self, part: CallPart, why: str) -> None:
        self._group.replace(part.index, part.actor, f"{why} (gen_id {part.request.gen_id})")
        fresh = self._launch(part.index, part.request)
        part.actor, part.ref, part.started = fresh.actor, fresh.ref, fresh.started
        part.launched_at = fresh.launched_at
        part.score_ref = None

    def _score(self, part: CallPart, index: int | None = None) -> None:
        """Hand the part's generation result (by reference) to a reward worker (the next one, or ``index``)."""
        index, ref = self._group.reward_pool.submit(part.ref, part.request.records, index)
        part.scorer, part.score_ref, part.score_started = index, ref, time.monotonic()
        part.score_actor = self._group.reward_pool.workers[index]

    def _rescore(self, part: CallPart, why: str) -> None:
        self._group.reward_pool.replace(
            part.scorer, part.score_actor, f"{why} (gen_id {part.request.gen_id})"
        )
        self._score(part, part.scorer)

    def _stage_deadline(self, part: CallPart) -> tuple[float, float]:
        """When the part's current stage (generation, or scoring on a reward worker) began, and how
        long it may take."""
        if part.score_ref is not None:
            return part.score_started, self._group.reward_pool.deadline_s(part.samples)
        return part.started, self._group.deadline_s(part.request)

    def _overdue(self, part: CallPart, now: float) -> float | None:
        """The deadline the part's current stage missed, None while it is within it."""
        started, deadline = self._stage_deadline(part)
        return deadline if now - started > deadline else None

    def _check(self, block_s: float) -> bool:
        """Collect finished parts, replace dead or overdue workers; True once every part is done."""
        import ray

        waiting = [p for p in self._parts if not p.done]
        if waiting:
            finished, _ = ray.wait(
                [p.final_ref for p in waiting], num_returns=1, timeout=block_s, fetch_local=False
            )
            finished = set(finished)
            for part in waiting:
                if part.final_ref in finished:
                    self._settle(part)
            now = time.monotonic()
            for part in self._parts:
                deadline = None if part.done else self._overdue(part, now)
                if deadline is not None and part.score_ref is not None:
                    self._rescore(part, f"did not score within {deadline:.0f} s")
                elif deadline is not None:
                    self._relaunch(part, f"did not answer within {deadline:.0f} s")
        return all(p.done for p in self._parts)

    def _settle(self, part: CallPart) -> None:
        import ray

        if part.score_ref is not None:
            self._settle_score(part)
            return
        failed = False
        try:
            ray.get(part.ref, timeout=0)
        except ray.exceptions.RayActorError as exc:  # the worker process died
            self._relaunch(part, f"died ({type(exc).__name__})")
            return
        except ray.exceptions.RayTaskError as exc:
            if is_engine_dead(exc.cause):  # the worker lives but its engine serves no more
                self._relaunch(part, f"lost its engine ({type(exc.cause).__name__}: {exc.cause})")
                return
            failed = True
        except ray.exceptions.GetTimeoutError:  # finished but not yet readable: look again later
            return
        except Exception:  # noqa: BLE001 - a failure inside the worker: result() raises it
            failed = True
        if self._group.reward_pool is not None and not failed:
            self._score(part)  # the rollout worker is free again; the reward worker scores
            return
        part.done = True
        part.reaped_at = time.time()

    def _settle_score(self, part: CallPart) -> None:
        import ray

        try:
            ray.get(part.score_ref, timeout=0)
        except ray.exceptions.RayActorError as exc:  # the reward worker died
            self._rescore(part, f"died ({type(exc).__name__})")
            return
        except ray.exceptions.GetTimeoutError:
            return
        except Exception:  # noqa: BLE001 - the reward raised: result() raises it
            pass
        part.done = True
        part.reaped_at = time.time()

    def ready(self) -> bool:
        return self._check(0)

    def _block_s(self, at_most: float) -> float:
        """How long to block before looking again: until the nearest deadline, at most ``at_most``."""
        now = time.monotonic()
        left = [sum(self._stage_deadline(p)) - now for p in self._parts if not p.done]
        return max(0.05, min([at_most, *left]))

    def wait(self) -> None:
        """Block until every part is done (replacing workers as needed); logs while it lasts."""
        every = self._group.log_every_s
        while not self._check(self._block_s(every)):
            now = time.monotonic()
            if now - self._last_log >= every:
                self._last_log = now
                for part in self._parts:
                    if not part.done:
                        log.warning(
                            "waiting %.0f s for rollout worker %d (gen_id %d; deadline %.0f s)",
                            now - part.started,
                            part.index,
                            part.request.gen_id,
                            self._group.deadline_s(part.request),
                        )

    def result(self) -> GenerationResult:
        import ray

        self.wait()
        return merge_results(ray.get([p.final_ref for p in self._parts]), self._parts)


def worker_loads(calls: list[GenerationCall], num_workers: int) -> list[int]:
    """Samples each worker is generating, over ``calls``: the parts not done whose generation is not
    finished (a part a reward worker is scoring no longer loads its rollout worker).

    >>> from types import SimpleNamespace as P
    >>> call = P(parts=[P(index=0, done=False, score_ref=None, samples=8), P(index=1, done=True, score_ref=None, samples=8),
    ...                 P(index=1, done=False, score_ref="scoring", samples=8)])
    >>> worker_loads([call], 2)
    [8, 0]
    """
    loads = [0] * num_workers
    for call in calls:
        for part in call.parts:
            if not part.done and part.score_ref is None and part.index < num_workers:
                loads[part.index] += part.samples
    return loads


def route(loads: list[int], sizes: list[int], start: int = 0) -> list[int]:
    """The worker each of the parts of ``sizes`` samples goes to: in turn, to the least-loaded worker
    (``loads``: samples each is generating, updated as parts are placed), ties to the first from
    ``start`` on, so equally loaded workers take turns.

    >>> route([16, 0, 8], [8, 8], start=0), route([0, 0, 0], [8], start=2), route([0, 0], [8, 8, 8], start=1)
    ([1, 1], [2], [1, 0, 1])
    """
    loads, n, chosen = list(loads), len(loads), []
    for size in sizes:
        worker = min(range(n), key=lambda i: (loads[i], (i - start) % n))
        loads[worker] += size
        chosen.append(worker)
    return chosen


def _part_span(result: GenerationResult, part: CallPart) -> dict[str, Any]:
    """One part's ``generate`` span on the driver's clock (see the module docstring)."""
    stamp = result.span or {"start": part.launched_at, "end": part.reaped_at}
    start, end = clamp_span(stamp["start"], stamp["end"], part.launched_at, part.reaped_at)
    rollouts = [r for group in result.groups for r in group]
    tokens = sum(len(r.completion_ids) for r in rollouts if isinstance(r, Rollout))
    return {
        "worker": part.index,
        "start": start,
        "end": end,
        "samples": len(rollouts),
        "completion_tokens": tokens,
        **({"occupancy": stamp["occupancy"]} if "occupancy" in stamp else {}),
    }


def merge_results(parts: list[GenerationResult], calls: list[CallPart] | None = None) -> GenerationResult:
    """One call's result from its parts' ``RolloutWorker.generate`` results (in worker order): every
    group, the slowest part's generation and scoring times, and one timeline span per part."""
    return GenerationResult(
        [group for part in parts for group in part.groups],
        generate_s=max(p.generate_s for p in parts),
        score_s=max(p.score_s for p in parts),
        spans=[_part_span(r, c) for r, c in zip(parts, calls or [])],
        score_spans=[p.score_span for p in parts if p.score_span is not None],  # reward workers' clocks
        reward_timeouts=sum(p.reward_timeouts for p in parts),
    )


@dataclass
class WorkerSubset:
    """Some workers of a group, shaped like the group for a weight-sync backend (``.workers``)."""

    workers: list[Any]
