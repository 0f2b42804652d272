"""A group of rollout workers: one engine per Ray actor, called without blocking.

Contract:

* :meth:`RolloutWorkerGroup.generate` splits a request across the workers (groups never straddle
  workers) and returns a :class:`~unirl_lightning.workers.calls.GenerationCall` at once (polled,
  waited on and reaped by the rollout controller; deadlines and relaunches are the call's). A request
  smaller than the group (``launch_unit: group``: one prompt's samples) goes to the least-loaded
  worker: the fewest samples in generation over the calls not yet collected, ties in turn
  (:func:`~unirl_lightning.workers.calls.route`).
* Worker faults: :meth:`RolloutWorkerGroup.replace` swaps a dead or hung worker for a new actor, then
  calls ``on_restart(index)`` (the rollout runtime pushes the current weights to it), up to
  ``max_restarts`` times in all; past that the run fails naming the worker and why. ``restarts``
  counts the replacements.
* Placement: a worker with GPUs or extra resources (``resources_per_worker``: custom resources,
  ``node:<ip>``) gets a placement group of its own
  (:func:`~unirl_lightning.workers.placement.place_workers`: ready within ``start_timeout_s`` or
  removed and an error naming the numbers); a replacement reuses its worker's group, and
  :meth:`RolloutWorkerGroup.shutdown` removes the groups. Every start is first checked against the
  resources Ray has free.
* The actor class is the group's ``worker_cls`` (:class:`~unirl_lightning.workers.actor.RolloutWorker`,
  or :class:`~unirl_lightning.workers.agentic_actor.AgenticRolloutWorker` for episodes).
* :meth:`RolloutWorkerGroup.shutdown` kills every actor; it runs on normal exit, on error and on
  Ctrl-C (the strategy calls it), and at interpreter exit as a last resort.
* Ray's connection is the group's: :meth:`RolloutWorkerGroup.connect` (every rank, before any worker
  starts: rank 0 starts or joins Ray, the others join it), :meth:`RolloutWorkerGroup.leave` (a joined
  rank at teardown) and :meth:`RolloutWorkerGroup.release` (the local Ray this process started).
"""

from __future__ import annotations

import atexit
import logging
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import ray

from unirl_lightning.core.preflight import WorkerLayout
from unirl_lightning.rollout.records import RolloutRequest
from unirl_lightning.workers.actor import RolloutWorker
from unirl_lightning.workers.calls import (
    GenerationCall,
    WorkerSubset,
    call_every,
    kill_actors,
    route,
    worker_loads,
)
from unirl_lightning.workers.cluster import (
    connect_ranks,
    ensure_ray,
    shutdown_ray_if_owned,
    worker_runtime_env,
)
from unirl_lightning.workers.factory import WorkerGroupSpec
from unirl_lightning.workers.placement import check_free, place_workers

__all__ = ["RolloutWorkerGroup", "WorkerSubset"]

log = logging.getLogger(__name__)


GENERATE_GROUP = "generate"  # a threaded worker's concurrency group of generate calls
CONTROL_THREADS = 2  # its threads for every other call (pushes, health checks, version reads)


class RolloutWorkerGroup:
    """``num_workers`` Ray actors, each running an engine built from ``engine_config``.

    Args:
        engine_config / policy / lora: what each worker serves (``engine_config.build(policy, lora)``).
        reward: scores each sample in the worker (None when ``reward_pool`` scores).
        reward_pool: a :class:`~unirl_lightning.workers.reward.RewardWorkerPool` that scores each
            finished part of a call on reward workers of its own (None: the workers score).
        num_workers / num_cpus_per_worker / num_gpus_per_worker / resources_per_worker / runtime_env:
            the actors and their Ray resources.
        layout: a GPU worker's placement group: ``"actor"`` (one bundle, the actor holds the GPUs)
            or ``"per_gpu"`` (a bundle per GPU, for an engine that starts Ray actors per GPU).
        start_timeout_s: how long the workers may take to start (model loading included).
        generation_timeout_s: how long one worker may take for a request of up to 1024 samples (a
            larger request gets proportionally longer); then it is replaced.
        max_restarts: replacements of dead or hung workers allowed over the group's life.
        log_every_s: a wait logs the workers it waits for at this interval.
        worker_cls: the actor class (:class:`~unirl_lightning.workers.actor.RolloutWorker` or a subclass).
        shares_trainer_device: the workers run on the training device (``placement="colocate"``): the
            runtime puts them to sleep while the trainer trains.
        share_weights: unused by Ray workers (their weights always travel); the in-process group's flag.

    Example::

        group = RolloutWorkerGroup(HFEngineConfig(), TinyCausalLM(), reward=ExactMatchReward(),
                                   num_workers=2, num_cpus_per_worker=1)
        pending = group.generate(RolloutRequest(records, n=8))
        groups = pending.result().groups
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
        layout: WorkerLayout = "actor",
        runtime_env: dict[str, Any] | None = None,
        start_timeout_s: float = 600.0,
        generation_timeout_s: float = 600.0,
        max_restarts: int = 3,
        log_every_s: float = 30.0,
        worker_cls: type = RolloutWorker,
        reward_pool: Any = None,
        shares_trainer_device: bool = False,
        share_weights: bool = False,
    ) -> None:
        self.shares_trainer_device = shares_trainer_device
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        ensure_ray()
        threads = getattr(engine_config, "num_threads", None)  # an engine's resolved torch threads
        # a continuously batching engine takes several calls at once (a threaded actor); others one.
        # Its generate calls run in a concurrency group of their own, so that pushes, health checks
        # and version reads always find a free thread, however many generate calls wait on their rows.
        concurrency = int(getattr(engine_config, "max_concurrency", 1))
        self._common = dict(runtime_env=worker_runtime_env(runtime_env, threads), max_concurrency=concurrency)
        self.generate_group: str | None = None
        if concurrency > 1 and worker_cls is RolloutWorker:  # (an agentic worker's calls all share one pool)
            self.generate_group = GENERATE_GROUP
            self._common.update(max_concurrency=CONTROL_THREADS)
            # concurrency groups are a class option in Ray, not an .options() one
            self._actor_cls = ray.remote(concurrency_groups={GENERATE_GROUP: concurrency})(worker_cls)
        else:
            self._actor_cls = ray.remote(worker_cls)
        self._placement: Any = None
        resources = dict(resources_per_worker or {})
        if num_gpus_per_worker > 0 or resources:  # a placement group per worker, ready or an error
            self._placement = place_workers(
                num_workers, num_cpus_per_worker, num_gpus_per_worker, resources, layout, start_timeout_s
            )
            self._options = list(self._placement.options)
        else:
            if num_cpus_per_worker > 0:
                check_free(num_workers, [{"CPU": float(num_cpus_per_worker)}])
            self._options = [dict(num_cpus=num_cpus_per_worker, num_gpus=0)] * num_workers
        self._actor_args = (engine_config, policy, lora, reward)
        self._next_worker = 0  # where ties between equally loaded workers start (round robin)
        self._live: weakref.WeakSet[GenerationCall] = weakref.WeakSet()  # calls not yet collected
        self.reward_pool = reward_pool
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
        except BaseException:
            self.shutdown()  # the actors and their placement groups
            raise

    @classmethod
    def from_spec(cls, spec: WorkerGroupSpec) -> RolloutWorkerGroup:
        """The group a runtime asks for (every field of the spec means something to Ray workers)."""
        fields = {name: getattr(spec, name) for name in spec.__dataclass_fields__}
        if fields["worker_cls"] is None:
            fields["worker_cls"] = RolloutWorker
        return cls(**fields)

    # -- Ray's connection, shared by the run's processes -----------------------------------------
    @classmethod
    def connect(
        cls,
        rank: int,
        world_size: int,
        settings: Any,
        trainer_devices: Sequence[Any],
        broadcast: Callable[..., Any],
    ) -> None:
        """One Ray for every rank (a collective: every rank calls it): rank 0 starts (or joins
        ``RAY_ADDRESS``) it, the others join it. A Ray it starts sees only the GPUs the training ranks
        (``trainer_devices``) leave, all of them when the workers share the trainer's device."""
        workers = world_size * settings.num_workers
        devices = [] if settings.shares_trainer_device else list(trainer_devices)
        cpus, gpus = math.ceil(workers * settings.num_cpus_per_worker), workers * settings.num_gpus_per_worker
        scoring = getattr(settings, "reward_workers", None)
        if scoring is not None:  # the reward workers' share of the spare GPUs and the CPUs
            scorers = world_size * scoring.num_workers
            cpus += math.ceil(scorers * scoring.num_cpus_per_worker)
            gpus += scorers * scoring.num_gpus_per_worker
        connect_ranks(rank, cpus, broadcast, devices, gpus)

    @classmethod
    def leave(cls, rank: int) -> None:
        """A joined rank (not rank 0) leaves Ray at teardown, before rank 0 stops it."""
        if rank != 0 and ray.is_initialized():
            ray.shutdown()

    @classmethod
    def release(cls) -> None:
        """Stop the local Ray this process started, if any (safe to call twice)."""
        shutdown_ray_if_owned()

    def _new_actor(self, index: int) -> Any:
        """Worker ``index``'s actor, with its own options (and placement group) each time."""
        return self._actor_cls.options(**self._common, **self._options[index]).remote(
            *self._actor_args, index
        )

    def deadline_s(self, request: RolloutRequest) -> float:
        """How long a worker may take for ``request``: ``generation_timeout_s`` per 1024 samples."""
        samples = len(request.records) * request.n
        return self.generation_timeout_s * max(1.0, samples / 1024)

    def loads(self) -> list[int]:
        """Samples each worker is generating now, over the calls not yet reaped (as last polled)."""
        return worker_loads(list(self._live), self.num_workers)

    def generate(self, request: RolloutRequest) -> GenerationCall:
        parts = request.split(self.num_workers)
        if len(parts) < self.num_workers:  # a small request (a group): to the least-loaded workers
            workers = route(self.loads(), [len(p.records) * p.n for p in parts], self._next_worker)
            self._next_worker = (workers[-1] + 1) % self.num_workers
            call = GenerationCall(self, list(zip(workers, parts)))
        else:
            call = GenerationCall(self, list(enumerate(parts)))
        self._live.add(call)
        return call

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
        return call_every(self.workers, "rollout workers", method, *args, timeout_s=timeout_s, **kwargs)

    def shutdown(self) -> None:
        """Close every engine (best effort, a few seconds), kill the actors, remove their placement
        groups."""
        workers = getattr(self, "workers", [])
        if workers and ray.is_initialized():  # without Ray (shut down already) a call would start a fresh one
            try:
                ray.get([w.close.remote() for w in workers], timeout=10)
            except Exception:  # noqa: BLE001 - a dead or stuck worker is killed below
                pass
            kill_actors(workers)
        self.workers = []
        if getattr(self, "_placement", None) is not None:
            self._placement.remove()
