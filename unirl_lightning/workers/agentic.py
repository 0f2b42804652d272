"""The driver's handle on the episode coordinators inside the rollout workers.

:class:`WorkerEpisodeCoordinator` implements the coordinator contract of
:mod:`unirl_lightning.agentic.controller` (plus ``suspended()``, see
:class:`~unirl_lightning.agentic.loop.SuspendingCoordinator`) over a
:class:`~unirl_lightning.workers.group.RolloutWorkerGroup`: every verb is one Ray call per worker,
answered by that worker's :class:`~unirl_lightning.envs.coordinator.EpisodeCoordinator`, with a
deadline.

* ``submit`` routes each episode to a worker by its group (a stable hash of the root), so the
  siblings of a group, and a suspended episode and its resumption, always meet the same worker;
  every worker gets a (possibly empty) drive, so each one discards the suspended episodes the
  drive does not resume.
* ``poll`` gathers every worker's finished episodes; ``finalize_if_drained`` is True once every
  worker's is (each worker's answer is atomic, and a worker that answered True stays drained, so
  the conjunction keeps the contract); ``abort`` aborts every worker in parallel and remembers the
  episodes they suspended (``suspended()``, cleared by the next ``submit``).
* An environment crash re-raises the worker's :class:`~unirl_lightning.envs.EnvStepError` itself
  (not Ray's wrapper), naming the environment and the record; so does an engine without
  ``generate_ids`` (``NotImplementedError`` naming it). A worker that misses a deadline
  raises ``TimeoutError`` naming the call. A dead worker is replaced (the group's
  ``max_restarts``; the replacement gets the current weights) and its live episodes restart from
  their first turn there, with their records and seeds (the driver keeps every episode submitted
  and not yet returned); a group whose other samples already finished keeps them. Past
  ``max_restarts`` the run fails naming the worker.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any

import ray

from unirl_lightning.agentic.controller import root_of
from unirl_lightning.core.seeding import eval_episode_seed
from unirl_lightning.envs.base import EnvStepError
from unirl_lightning.envs.coordinator import EpisodeRequest

__all__ = ["WorkerEpisodeCoordinator"]

log = logging.getLogger(__name__)


class WorkerEpisodeCoordinator:
    """The agentic coordinator contract over the workers' episode coordinators (Ray calls with deadlines).

    Args:
        workers: the rollout worker group (its ``workers`` list is read at every call).
        env: the environment spec the workers build episodes from.
        sampling: the per-turn sampling parameters.
        settings: the episodes' :class:`~unirl_lightning.envs.coordinator.EpisodeSettings` (environment
            errors, truncated turns, context budget), or just ``on_env_error`` (``"raise"``/``"drop"``).
        call_timeout_s: deadline of ``submit`` / ``poll`` / ``finalize_if_drained`` (they do not wait
            for generation).
        abort_timeout_s: deadline of ``abort``, which waits for the turn in progress.

    Example::

        coordinator = WorkerEpisodeCoordinator(group, env_spec, SamplingParams(max_new_tokens=4))
        controller = AgenticRolloutController(coordinator, group_size=8, tail_policy="carry")
    """

    def __init__(
        self,
        workers: Any,
        env: Any,
        sampling: Any,
        settings: Any = "raise",
        call_timeout_s: float = 120.0,
        abort_timeout_s: float = 600.0,
    ) -> None:
        self.workers = workers
        self.env = env
        self.sampling = sampling
        self.settings = settings
        self.call_timeout_s = call_timeout_s
        self.abort_timeout_s = abort_timeout_s
        self._suspended: list[str] = []
        self._live: dict[str, EpisodeRequest] = {}  # submitted and not yet returned (suspended included)
        self.relaunched = 0  # episodes restarted on a replacement worker

    def worker_of(self, sample_id: str) -> int:
        """The worker that plays ``sample_id`` (all siblings of a group on one worker)."""
        return zlib.crc32(root_of(sample_id).encode()) % len(self.workers.workers)

    def submit(self, requests: list[EpisodeRequest]) -> None:
        named = {request.sample_id for request in requests}
        for sample_id in self._suspended:  # suspended episodes not resumed now are dropped for good
            if sample_id not in named:
                self._live.pop(sample_id, None)
        parts: list[list[EpisodeRequest]] = [[] for _ in self.workers.workers]
        for request in requests:
            self._live.setdefault(request.sample_id, request)
            parts[self.worker_of(request.sample_id)].append(request)
        self._suspended = []
        self._gather(
            "agentic_submit",
            [(self.env, self.sampling, self.settings, part) for part in parts],
            self.call_timeout_s,
        )

    def poll(self) -> list[Any]:
        answers = self._gather("agentic_poll", [()] * len(self.workers.workers), self.call_timeout_s)
        return self._returned([sample for answer in answers for sample in answer])

    def finalize_if_drained(self) -> bool:
        answers = self._gather(
            "agentic_finalize_if_drained", [()] * len(self.workers.workers), self.call_timeout_s
        )
        return all(answers)

    def abort(self) -> list[Any]:
        answers = self._gather("agentic_abort", [()] * len(self.workers.workers), self.abort_timeout_s)
        self._suspended = [sample_id for _, suspended in answers for sample_id in suspended]
        return self._returned([sample for finished, _ in answers for sample in finished])

    def suspended(self) -> list[str]:
        """Sample ids of the episodes the last ``abort`` suspended (empty after a ``submit``)."""
        return list(self._suspended)

    def evaluate(
        self, records: list[dict[str, Any]], sampling: Any, n: int, seed: int, timeout_s: float
    ) -> list[list[Any]]:
        """Play ``n`` episodes per record with the weights the workers hold now (read-only), spread
        over the workers; returns one group of samples per record, in order."""
        requests = [
            EpisodeRequest(f"eval{i}/{k}", record, eval_episode_seed(seed, i, k))
            for i, record in enumerate(records)
            for k in range(n)
        ]
        actors = list(self.workers.workers)
        parts = [requests[i :: len(actors)] for i in range(len(actors))]
        refs = [
            actor.agentic_evaluate.remote(self.env, sampling, part, timeout_s, self.settings)
            for actor, part in zip(actors, parts)
            if part
        ]
        try:
            samples = [sample for answer in ray.get(refs, timeout=timeout_s + 30) for sample in answer]
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(f"evaluation episodes did not finish within {timeout_s:.0f} s") from exc
        groups: dict[str, list[Any]] = {f"eval{i}": [] for i in range(len(records))}
        for sample in samples:
            groups[root_of(sample.sample_id)].append(sample)
        return [sorted(group, key=lambda s: s.sample_id) for group in groups.values()]

    def _returned(self, samples: list[Any]) -> list[Any]:
        for sample in samples:
            self._live.pop(sample.sample_id, None)
        return samples

    def _gather(self, method: str, args: list[tuple[Any, ...]], timeout_s: float) -> list[Any]:
        """Every worker's answer to ``method``; a dead worker is replaced and answers for itself
        (:meth:`_replace`), so the other workers' answers are never lost."""
        actors = list(self.workers.workers)
        refs = [getattr(actor, method).remote(*arg) for actor, arg in zip(actors, args)]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(ready) < len(refs):
            raise TimeoutError(
                f"rollout workers did not answer {method}() within {timeout_s:.0f} s (an environment step or a "
                "generation call may hang)"
            )
        answers = []
        for index, (actor, ref) in enumerate(zip(actors, refs)):
            try:
                answers.append(ray.get(ref))
            except ray.exceptions.RayActorError as exc:
                answers.append(self._replace(index, actor, method, exc))
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, (EnvStepError, NotImplementedError)):  # the error, not Ray's wrapper
                    raise exc.cause from None
                raise
        return answers

    def _replace(self, index: int, actor: Any, method: str, exc: BaseException) -> Any:
        """Worker ``index`` died during ``method``: replace it (it gets the current weights; past
        ``max_restarts`` the run fails naming it) and restart its live episodes from their first turn
        on the replacement. During an abort they are not started but reported as suspended, so the
        tail policy decides (carry: they restart in the next drive; drop: they are dropped).
        Returns the answer the replacement gives for ``method``."""
        lost = [request for sample_id, request in self._live.items() if self.worker_of(sample_id) == index]
        self.workers.replace(index, actor, f"died during {method}() ({type(exc).__name__})")
        self.relaunched += len(lost)
        log.warning(
            "rollout worker %d died: restarting its %d live episode(s) on its replacement", index, len(lost)
        )
        if method == "agentic_abort":
            return [], [request.sample_id for request in lost]
        if lost:
            restart = self.workers.workers[index].agentic_submit.remote(
                self.env, self.sampling, self.settings, lost
            )
            ray.get(restart, timeout=self.call_timeout_s)
        return {"agentic_submit": None, "agentic_poll": [], "agentic_finalize_if_drained": not lost}[method]
