"""Reward workers: the module's reward on Ray actors of its own (a learned reward model on its own GPUs).

Why a strategy setting (``reward_workers``) and not a wrapper reward
    Where a reward runs is placement, and placement is the strategy's (the module says *what* is
    scored, in its YAML as before). The runtime starts the pool next to the rollout workers, with the
    same placement groups, the same free-resource check and the same overlap check, and writes it into
    ``placement.json``; a wrapper reward would have to start actors from inside a rollout worker (one
    pool per worker, placed by no one) or hide a pool in a picklable object.

How scoring overlaps generation
    A rollout worker with a pool behind it does not score: its ``generate`` returns as soon as the
    engine is done, so its next request starts generating at once. The driver's
    :class:`~unirl_lightning.workers.calls.GenerationCall` then hands the generation result *by
    reference* (a Ray ``ObjectRef``: the rollouts go worker -> object store -> reward worker, never
    through the driver) to a reward worker, round robin, and the part is done when the scored result
    is back. Nothing blocks: the driver polls both stages with ``ray.wait``.

Contract
    :meth:`RewardWorker.score` scores every group of one generation result with
    :func:`~unirl_lightning.workers.actor.score_groups` (the rollout worker's own rule: totals and
    each part), so ``rollout/reward/<name>_mean``, the completions table and ``CombinedReward`` read
    the same as when the rollout workers score. A reward that raises fails the call with its
    :class:`~unirl_lightning.rewards.RewardError`. A reward worker that dies or misses its deadline is
    replaced (same placement group) and the scoring relaunched on the kept generation result, up to
    ``max_restarts`` times. Weight pushes never reach the pool: only the rollout workers are a
    weight-sync target, so a reward model is frozen by construction.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import time
from typing import Any

import ray

from unirl_lightning.rollout.records import GenerationResult
from unirl_lightning.workers.actor import score_groups
from unirl_lightning.workers.calls import call_every, kill_actors
from unirl_lightning.workers.cluster import ensure_ray, worker_runtime_env
from unirl_lightning.workers.placement import check_free, place_workers

__all__ = ["RewardWorker", "RewardWorkerPool"]

log = logging.getLogger(__name__)


class RewardWorker:
    """Holds the module's reward (a reward model loads on its first call, here) and scores results.
    Ray wraps this class as an actor."""

    def __init__(self, reward: Any, worker_index: int = 0) -> None:
        self.reward = reward
        self.worker_index = worker_index

    def score(self, result: GenerationResult, records: list[dict[str, Any]]) -> GenerationResult:
        """``result`` (a rollout worker's ``generate`` answer, unscored) with every rollout scored;
        ``records[i]`` is the prompt record of ``result.groups[i]``."""
        started_at, start = time.time(), time.perf_counter()
        timeouts = score_groups(self.reward, result.groups, records)
        return dataclasses.replace(
            result,
            score_s=time.perf_counter() - start,
            reward_timeouts=result.reward_timeouts + timeouts,
            score_span={"start": started_at, "end": time.time(), "reward_worker": self.worker_index},
        )

    def ping(self) -> int:
        return self.worker_index

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(worker, *args)`` in the reward worker (a probe for tests and debugging)."""
        return fn(self, *args, **kwargs)

    def placement_info(self) -> dict[str, Any]:
        """Where this reward worker runs: its index, node, Ray GPU ids and ``CUDA_VISIBLE_DEVICES``."""
        from unirl_lightning.workers.placement import actor_placement_info

        return {"reward_worker": self.worker_index, **actor_placement_info()}


class RewardWorkerPool:
    """``settings.num_workers`` :class:`RewardWorker` actors holding ``reward``, placed like rollout
    workers (a placement group each when they ask for GPUs or resources, ready within
    ``start_timeout_s`` or an error naming the numbers; otherwise checked against Ray's free CPUs).

    Args:
        reward: the module's reward (shipped to each actor; a reward model loads there, lazily).
        settings: the strategy's :class:`~unirl_lightning.runtime.RewardWorkers`.
        start_timeout_s: how long the actors may take to start.
        max_restarts: replacements of dead or hung reward actors over the pool's life.

    Example::

        pool = RewardWorkerPool(RewardModelReward("/models/rm"), RewardWorkers(num_gpus_per_worker=1))
        scored = ray.get(pool.submit(generation_ref, records)[1])
    """

    def __init__(
        self, reward: Any, settings: Any, start_timeout_s: float = 600.0, max_restarts: int = 3
    ) -> None:
        ensure_ray()
        self.settings = settings
        self.max_restarts = max_restarts
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self._actor_cls = ray.remote(RewardWorker)
        self._placement: Any = None
        n, cpus, gpus = settings.num_workers, settings.num_cpus_per_worker, settings.num_gpus_per_worker
        resources = dict(settings.resources_per_worker or {})
        if gpus > 0 or resources:
            self._placement = place_workers(n, cpus, gpus, resources, "actor", start_timeout_s)
            self._options = list(self._placement.options)
        else:
            if cpus > 0:
                check_free(n, [{"CPU": float(cpus)}])
            self._options = [dict(num_cpus=cpus, num_gpus=0)] * n
        self._reward = reward
        self.workers = [self._new_actor(i) for i in range(n)]
        self._next = 0
        atexit.register(self.shutdown)
        try:
            ray.get([w.ping.remote() for w in self.workers], timeout=start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _new_actor(self, index: int) -> Any:
        options = dict(max_concurrency=1, runtime_env=worker_runtime_env(), **self._options[index])
        return self._actor_cls.options(**options).remote(self._reward, index)

    def deadline_s(self, samples: int) -> float:
        """How long a reward actor may take for ``samples`` samples: ``timeout_s`` per 1024."""
        return self.settings.timeout_s * max(1.0, samples / 1024)

    def submit(self, result: Any, records: list[dict[str, Any]], index: int | None = None) -> tuple[int, Any]:
        """Score ``result`` (an ``ObjectRef`` of a generation result, or the result) on reward worker
        ``index`` (None: the next one, round robin); returns ``(index, ref of the scored result)``."""
        if index is None:
            index, self._next = self._next, (self._next + 1) % len(self.workers)
        return index, self.workers[index].score.remote(result, records)

    def replace(self, index: int, actor: Any, why: str) -> None:
        """Replace reward worker ``index`` because it ``why`` (a no-op when it was replaced already)."""
        if self.workers[index] is not actor:
            return
        if self.restarts >= self.max_restarts:
            raise RuntimeError(
                f"reward worker {index} {why}; no restart left (max_restarts={self.max_restarts}, "
                f"{self.restarts} used): raise max_worker_restarts, or reward_workers.timeout_s if it is only slow"
            )
        log.warning("reward worker %d %s: replacing it (restart %d of %d)", index, why, self.restarts + 1,
                    self.max_restarts)  # fmt: skip
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.workers[index] = self._new_actor(index)
        ray.get(self.workers[index].ping.remote(), timeout=self.start_timeout_s)
        self.restarts += 1

    def call(self, method: str, *args: Any, timeout_s: float | None = 600.0, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every reward worker and wait for all answers (at most ``timeout_s``)."""
        return call_every(self.workers, "reward workers", method, *args, timeout_s=timeout_s, **kwargs)

    def shutdown(self) -> None:
        """Kill the actors and remove their placement groups (safe to call twice)."""
        workers = getattr(self, "workers", [])
        if workers and ray.is_initialized():  # without Ray a call would start a fresh one
            kill_actors(workers)
        self.workers = []
        if self._placement is not None:
            self._placement.remove()
            self._placement = None
