"""A group of rollout workers: one engine per Ray actor, called without blocking.

Contract:

* :func:`ensure_ray` joins the cluster named by ``RAY_ADDRESS`` or starts a local Ray on demand
  (and only then owns it: :func:`shutdown_ray_if_owned` stops it). A local Ray lives in a temp
  folder of its own, removed at shutdown, and a watchdog process
  (:mod:`unirl_lightning.ray_watchdog`) ends every process of it within a second or so of the
  driver's death, SIGKILL included.
* :meth:`RolloutWorkerGroup.generate` splits a request across the workers (groups never straddle
  workers) and returns a :class:`PendingCall` at once; the rollout controller polls it with
  ``ready()`` and reaps it with ``result()``. ``result()`` is retryable: a failure raises and the
  call stays reapable. ``ready()`` never raises for a failure inside a worker (``result()`` does).
* Generation has a deadline: each part of a call must answer within ``generation_timeout_s``
  (scaled by the samples it asks for, :meth:`RolloutWorkerGroup.deadline_s`); a wait logs a line
  every ``log_every_s`` while it lasts.
* Worker faults: a worker that dies, or misses its deadline, is replaced (a new actor, then
  ``on_restart(index)`` — the strategy pushes the current weights to it) and its part of every
  call in flight is relaunched as it was (same records, seed and gen_id, so the same launch-time
  version stamp), up to ``max_restarts`` times in all; past that the call fails with an error
  naming the worker, the gen_id and how long it waited. ``restarts`` counts the replacements.
* Rewards are scored inside the worker, right after generation, so scoring overlaps training too.
  A reward scores each sample's ``reward_input`` (the text of a token rollout, the image of a
  diffusion rollout).
  A reward that raises fails the call with :class:`~unirl_lightning.rewards.RewardError`, which
  names the reward and the prompt.
* Agentic episodes: ``RolloutWorker.agentic_submit`` / ``agentic_poll`` /
  ``agentic_finalize_if_drained`` / ``agentic_abort`` run an
  :class:`~unirl_lightning.envs.coordinator.EpisodeCoordinator` in a thread of the worker (the
  driver reaches them through :mod:`unirl_lightning.workers.agentic`); ``load_weights`` refuses
  while its drive is live.
* :meth:`RolloutWorkerGroup.shutdown` kills every actor; it runs on normal exit, on error and on
  Ctrl-C (the strategy calls it), and at interpreter exit as a last resort.
"""

from __future__ import annotations

import atexit
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import ray

from unirl_lightning.ray_watchdog import start_watchdog, stop_watchdog
from unirl_lightning.rollout.types import Rollout, RolloutRequest
from unirl_lightning.weight_sync.buckets import PackedWeights

log = logging.getLogger(__name__)

_STARTED_BY_US = False
_OWNED: dict[str, Any] = {}  # the local Ray's temp folder and watchdog, when this process started it


def ensure_ray(num_cpus: int | None = None, object_store_memory: int | None = None) -> None:
    """Join ``RAY_ADDRESS`` if set, else start a local Ray unless one is running already.

    The local object store holds every weight push (the full weights of a model as one object), so
    by default it takes 30% of the memory up to 4 GiB: a push larger than the store falls back to
    disk (measured: a 538 MB push took 0.7-2.7 s with a 512 MB store, 0.05-0.46 s with 2 GiB)."""
    global _STARTED_BY_US
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    if object_store_memory is None:
        object_store_memory = min(4 * 1024**3, int(0.3 * psutil.virtual_memory().total))
    # a short folder of its own (Ray's socket paths must stay under 108 bytes), removed at shutdown
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
    spared = [p.pid for p in psutil.Process().children(recursive=True)]  # e.g. other training ranks
    ray.init(
        num_cpus=num_cpus or max(2, os.cpu_count() or 1),
        object_store_memory=object_store_memory,
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=True,
        logging_level=logging.WARNING,
        _temp_dir=temp_dir,
    )
    _STARTED_BY_US = True
    _OWNED.update(temp_dir=temp_dir, watchdog=start_watchdog(temp_dir, spared))


def shutdown_ray_if_owned() -> None:
    """Stop the local Ray this process started (if any) and remove its temp folder."""
    global _STARTED_BY_US
    if _STARTED_BY_US and ray.is_initialized():
        ray.shutdown()
    _STARTED_BY_US = False
    watchdog = _OWNED.pop("watchdog", None)
    if watchdog is not None:
        stop_watchdog(watchdog)  # it removes the temp folder
    _OWNED.pop("temp_dir", None)


def _check_fits(num_workers: int, cpus: float, gpus: float, resources: dict[str, float]) -> None:
    """Fail at once, naming the numbers, when the cluster can never hold the workers."""
    total = ray.cluster_resources()
    wanted = {"CPU": cpus * num_workers, "GPU": gpus * num_workers}
    wanted.update({k: v * num_workers for k, v in resources.items()})
    for key, amount in wanted.items():
        if amount > total.get(key, 0.0) + 1e-9:
            raise RuntimeError(
                f"{num_workers} rollout worker(s) need {key}={amount:g} in total but the Ray cluster has "
                f"{key}={total.get(key, 0.0):g}; lower num_workers or the per-worker resources"
            )


class _SerialEngine:
    """An engine whose ``generate_ids`` holds a lock (everything else is the engine's own)."""

    def __init__(self, engine: Any, lock: threading.Lock) -> None:
        self._engine, self._lock = engine, lock

    def generate_ids(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._engine.generate_ids(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class RolloutWorker:
    """Runs one engine, built from ``engine_config`` for the module's ``policy`` and ``lora``, and
    scores its groups. Ray wraps this class as an actor."""

    def __init__(
        self, engine_config: Any, policy: Any, lora: Any, reward: Any, worker_index: int = 0
    ) -> None:
        self.engine = engine_config.build(policy, lora)
        self.reward = reward
        self.worker_index = worker_index
        self.coordinator: Any = None  # the agentic EpisodeCoordinator, built by the first agentic_submit
        self._coordinator_settings: Any = None
        self._generation_lock = threading.Lock()  # a training drive and an evaluation take turns

    def generate(self, request: RolloutRequest) -> dict[str, Any]:
        from unirl_lightning.rewards import score_batch

        start = time.perf_counter()
        groups = self.engine.generate(request)
        generate_s = time.perf_counter() - start
        if self.reward is not None:
            for group, record in zip(groups, request.records):
                completions = [r.reward_input for r in group]
                scores = score_batch(self.reward, completions, [record] * len(group))
                for rollout, score in zip(group, scores):
                    rollout.reward = float(score)
        return {
            "groups": groups,
            "generate_s": generate_s,
            "score_s": time.perf_counter() - start - generate_s,
        }

    def load_weights(self, named_tensors: Any, weight_version: int) -> int:
        if self.coordinator is not None and self.coordinator.drive_live:
            raise RuntimeError(
                f"load_weights(weight_version={weight_version}) refused: an agentic drive is live in rollout "
                f"worker {self.worker_index}; quiesce (abort) it first so no episode turn straddles two versions"
            )
        if isinstance(named_tensors, PackedWeights):  # the object store's push: views of shared memory
            named_tensors = named_tensors.tensors()
        elif isinstance(named_tensors, dict):
            named_tensors = named_tensors.items()
        self.engine.load_weights(named_tensors, weight_version)
        return weight_version

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(worker, *args)`` in the worker (weight-sync backends use it)."""
        return fn(self, *args, **kwargs)

    def weight_version(self) -> int:
        return self.engine.weight_version

    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.close()
        self.engine.close()

    # -- agentic episodes: the coordinator contract of rollout/agentic.py, driven in a thread here --
    def agentic_submit(self, env: Any, sampling: Any, on_env_error: str, requests: list[Any]) -> None:
        """Start a drive of ``requests`` (:class:`~unirl_lightning.envs.coordinator.EpisodeRequest`)."""
        from unirl_lightning.envs.coordinator import EpisodeCoordinator

        settings = (env, sampling, on_env_error)
        if self.coordinator is None or self._coordinator_settings != settings:
            if self.coordinator is not None:
                self.coordinator.close()
            self.coordinator = EpisodeCoordinator(self._episode_engine(), env, sampling, on_env_error)
            self._coordinator_settings = settings
        self.coordinator.submit(requests)

    def agentic_evaluate(self, env: Any, sampling: Any, requests: list[Any], timeout_s: float) -> list[Any]:
        """Play ``requests`` to the end with the weights held now and return their samples: read-only
        (no weight or version change), a failing environment ends its episode with reward 0
        (``on_env_error="drop"``). A live training drive goes on meanwhile, turn by turn in between."""
        from unirl_lightning.envs.coordinator import EpisodeCoordinator

        coordinator = EpisodeCoordinator(self._episode_engine(), env, sampling, "drop")
        coordinator.submit(requests)
        deadline = time.monotonic() + timeout_s
        samples: list[Any] = []
        while not coordinator.finalize_if_drained():
            samples += coordinator.poll()
            if time.monotonic() > deadline:
                coordinator.close()
                raise TimeoutError(
                    f"rollout worker {self.worker_index}: {len(requests)} evaluation episodes did not finish "
                    f"within {timeout_s:.0f} s"
                )
            time.sleep(0.005)
        return samples + coordinator.poll()

    def _episode_engine(self) -> Any:
        """The engine as episode coordinators see it: one generation call at a time."""
        if not callable(getattr(self.engine, "generate_ids", None)):
            return self.engine  # the coordinator refuses it, naming the engine
        return _SerialEngine(self.engine, self._generation_lock)

    def agentic_poll(self) -> list[Any]:
        return [] if self.coordinator is None else self.coordinator.poll()

    def agentic_finalize_if_drained(self) -> bool:
        return self.coordinator is None or self.coordinator.finalize_if_drained()

    def agentic_abort(self) -> tuple[list[Any], list[str]]:
        """The samples finished during the abort, and the ids of the episodes it suspended."""
        if self.coordinator is None:
            return [], []
        return self.coordinator.abort(), self.coordinator.suspended()


@dataclass
class _Part:
    """One worker's share of a call: what it was asked, on which actor, since when, with what result."""

    index: int
    request: RolloutRequest
    actor: Any
    ref: Any
    started: float
    done: bool = False


class PendingCall:
    """Non-blocking handle on one request spread over several workers (``ready/wait/result``).

    Watches every part: a part whose worker died, or that is past its deadline, is relaunched on a
    replacement worker (see the module docstring). A part that failed inside the worker (e.g. a
    reward error) counts as done; ``result()`` raises that error, and raises it again if called
    again (retryable).
    """

    def __init__(self, group: RolloutWorkerGroup, parts: list[tuple[int, RolloutRequest]]) -> None:
        self._group = group
        self._parts = [self._launch(index, request) for index, request in parts]
        self._last_log = time.monotonic()

    def _launch(self, index: int, request: RolloutRequest) -> _Part:
        actor = self._group.workers[index]
        return _Part(index, request, actor, actor.generate.remote(request), time.monotonic())

    def _relaunch(self, part: _Part, why: str) -> None:
        self._group.replace(part.index, part.actor, f"{why} (gen_id {part.request.gen_id})")
        fresh = self._launch(part.index, part.request)
        part.actor, part.ref, part.started = fresh.actor, fresh.ref, fresh.started

    def _check(self, block_s: float) -> bool:
        """Collect finished parts, replace dead or overdue workers; True once every part is done."""
        waiting = [p for p in self._parts if not p.done]
        if waiting:
            finished, _ = ray.wait(
                [p.ref for p in waiting], num_returns=1, timeout=block_s, fetch_local=False
            )
            finished = set(finished)
            for part in waiting:
                if part.ref in finished:
                    self._settle(part)
            now = time.monotonic()
            for part in self._parts:
                deadline = self._group.deadline_s(part.request)
                if not part.done and now - part.started > deadline:
                    self._relaunch(part, f"did not answer within {deadline:.0f} s")
        return all(p.done for p in self._parts)

    def _settle(self, part: _Part) -> None:
        try:
            ray.get(part.ref, timeout=0)
        except ray.exceptions.RayActorError as exc:  # the worker process died
            self._relaunch(part, f"died ({type(exc).__name__})")
            return
        except ray.exceptions.GetTimeoutError:  # finished but not yet readable: look again later
            return
        except Exception:  # noqa: BLE001 - a failure inside the worker: result() raises it
            pass
        part.done = True

    def ready(self) -> bool:
        return self._check(0)

    def _block_s(self, at_most: float) -> float:
        """How long to block before looking again: until the nearest deadline, at most ``at_most``."""
        now = time.monotonic()
        left = [p.started + self._group.deadline_s(p.request) - now for p in self._parts if not p.done]
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

    def result(self) -> dict[str, Any]:
        self.wait()
        return _merge_generate(ray.get([p.ref for p in self._parts]))


def _merge_generate(parts: list[dict[str, Any]]) -> dict[str, Any]:
    groups: list[list[Rollout]] = []
    for part in parts:
        groups.extend(part["groups"])
    return {
        "groups": groups,
        "generate_s": max(p["generate_s"] for p in parts),
        "score_s": max(p["score_s"] for p in parts),
    }


class RolloutWorkerGroup:
    """``num_workers`` Ray actors, each running an engine built from ``engine_config``.

    Args:
        engine_config / policy / lora: what each worker serves (``engine_config.build(policy, lora)``).
        reward: scores each sample in the worker.
        num_workers / num_cpus_per_worker / num_gpus_per_worker / resources_per_worker / runtime_env:
            the actors and their Ray resources.
        start_timeout_s: how long the workers may take to start (model loading included).
        generation_timeout_s: how long one worker may take for a request of up to 1024 samples (a
            larger request gets proportionally longer); then it is replaced.
        max_restarts: replacements of dead or hung workers allowed over the group's life.
        log_every_s: a wait logs the workers it waits for at this interval.

    Example::

        group = RolloutWorkerGroup(HFEngineConfig(), TinyCausalLM(), reward=ExactMatchReward(),
                                   num_workers=2, num_cpus_per_worker=1)
        pending = group.generate(RolloutRequest(records, n=8))
        groups = pending.result()["groups"]
    """

    def __init__(
        self,
        engine_config: Any,
        policy: Any,
        lora: Any = None,
        reward: Any = None,
        num_workers: int = 1,
        num_cpus_per_worker: float = 1,
        num_gpus_per_worker: float = 0,
        resources_per_worker: dict[str, float] | None = None,
        runtime_env: dict[str, Any] | None = None,
        start_timeout_s: float = 600.0,
        generation_timeout_s: float = 600.0,
        max_restarts: int = 3,
        log_every_s: float = 30.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        ensure_ray()
        self._actor_cls = ray.remote(RolloutWorker).options(
            num_cpus=num_cpus_per_worker,
            num_gpus=num_gpus_per_worker,
            resources=resources_per_worker or {},
            runtime_env=runtime_env,
            max_concurrency=1,
        )
        _check_fits(num_workers, num_cpus_per_worker, num_gpus_per_worker, resources_per_worker or {})
        self._actor_args = (engine_config, policy, lora, reward)
        self.workers = [self._new_actor(i) for i in range(num_workers)]
        self.num_workers = num_workers
        self.start_timeout_s = start_timeout_s
        self.generation_timeout_s = generation_timeout_s
        self.max_restarts = max_restarts
        self.log_every_s = log_every_s
        self.restarts = 0
        self.on_restart: Callable[[int], None] | None = None  # e.g. push the current weights to it
        atexit.register(self.shutdown)
        # surface construction errors (a bad engine config, a missing extra) here, not at first use
        try:
            ray.get([w.weight_version.remote() for w in self.workers], timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            self.shutdown()
            raise RuntimeError(
                f"{num_workers} rollout worker(s) did not start within start_timeout_s={start_timeout_s}s; Ray "
                f"has {ray.available_resources()} free (each worker asks for num_cpus={num_cpus_per_worker}, "
                f"num_gpus={num_gpus_per_worker}): other actors may hold the resources"
            ) from exc

    def _new_actor(self, index: int) -> Any:
        return self._actor_cls.remote(*self._actor_args, index)

    def deadline_s(self, request: RolloutRequest) -> float:
        """How long a worker may take for ``request``: ``generation_timeout_s`` per 1024 samples."""
        samples = len(request.records) * request.n
        return self.generation_timeout_s * max(1.0, samples / 1024)

    def generate(self, request: RolloutRequest) -> PendingCall:
        parts = request.split(self.num_workers)
        return PendingCall(self, list(enumerate(parts)))

    def replace(self, index: int, actor: Any, why: str) -> None:
        """Replace worker ``index`` because it ``why``; a no-op when ``actor`` was replaced already
        (another call in flight saw the same fault first)."""
        if self.workers[index] is not actor:
            return
        if self.restarts >= self.max_restarts:
            raise RuntimeError(
                f"rollout worker {index} {why}; no restart left (max_restarts={self.max_restarts}, "
                f"{self.restarts} used): raise max_restarts, or generation_timeout_s if it is only slow"
            )
        log.warning(
            "rollout worker %d %s: replacing it (restart %d of %d)",
            index,
            why,
            self.restarts + 1,
            self.max_restarts,
        )
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.workers[index] = self._new_actor(index)
        ray.get(self.workers[index].weight_version.remote(), timeout=self.start_timeout_s)
        self.restarts += 1
        if self.on_restart is not None:
            self.on_restart(index)

    def ensure_alive(self, timeout_s: float = 30.0) -> None:
        """Replace every worker that is dead or does not answer a ping within ``timeout_s``. Call it
        while nothing is in flight (an idle worker answers at once), e.g. before a weight push."""
        actors = list(self.workers)
        pings = [actor.weight_version.remote() for actor in actors]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
        for index, (actor, ping) in enumerate(zip(actors, pings)):
            if ping not in ready:
                self.replace(index, actor, f"did not answer a ping within {timeout_s:.0f} s")
                continue
            try:
                ray.get(ping)
            except ray.exceptions.RayActorError as exc:
                self.replace(index, actor, f"died ({type(exc).__name__})")

    def subset(self, indices: list[int]) -> WorkerSubset:
        """A view of some workers, for a weight push to them alone (e.g. a replacement)."""
        return WorkerSubset([self.workers[i] for i in indices])

    def call(self, method: str, *args: Any, timeout_s: float | None = 600.0, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every worker and wait for all answers (at most ``timeout_s``)."""
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(f"rollout workers did not answer {method}() within {timeout_s} s") from exc

    def shutdown(self) -> None:
        """Close every engine (best effort, a few seconds), then kill the actors."""
        workers = getattr(self, "workers", [])
        if workers and ray.is_initialized():
            try:
                ray.get([w.close.remote() for w in workers], timeout=10)
            except Exception:  # noqa: BLE001 - a dead or stuck worker is killed below
                pass
        for worker in workers:
            try:
                ray.kill(worker)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self.workers = []


@dataclass
class WorkerSubset:
    """Some workers of a group, shaped like the group for a weight-sync backend (``.workers``)."""

    workers: list[Any]
