"""A group of rollout workers: one engine per Ray actor, called without blocking.

Contract:

* :func:`ensure_ray` joins the cluster named by ``RAY_ADDRESS`` or starts a local Ray on demand
  (and only then owns it: :meth:`RolloutWorkerGroup.shutdown` stops what it started).
* :meth:`RolloutWorkerGroup.generate` splits a request across the workers (groups never straddle
  workers) and returns a :class:`PendingCall` at once; the rollout controller polls it with
  ``ready()`` and reaps it with ``result()``. ``result()`` is retryable: a failure raises and the
  call stays reapable.
* Rewards are scored inside the worker, right after generation, so scoring overlaps training too.
  A reward scores each sample's ``reward_input`` (the text of a token rollout, the image of a
  diffusion rollout).
  A reward that raises fails the call with :class:`~unirl_lightning.rewards.RewardError`, which
  names the reward and the prompt.
* :meth:`RolloutWorkerGroup.shutdown` kills every actor; it runs on normal exit, on error and on
  Ctrl-C (the strategy calls it), and at interpreter exit as a last resort.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import ray

from unirl_lightning.rollout.types import Rollout, RolloutRequest

log = logging.getLogger(__name__)

_STARTED_BY_US = False


def ensure_ray(num_cpus: int | None = None, object_store_memory: int | None = 512 * 1024**2) -> None:
    """Join ``RAY_ADDRESS`` if set, else start a local Ray unless one is running already."""
    global _STARTED_BY_US
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    ray.init(
        num_cpus=num_cpus or max(2, os.cpu_count() or 1),
        object_store_memory=object_store_memory,
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=True,
        logging_level=logging.WARNING,
    )
    _STARTED_BY_US = True


def shutdown_ray_if_owned() -> None:
    global _STARTED_BY_US
    if _STARTED_BY_US and ray.is_initialized():
        ray.shutdown()
    _STARTED_BY_US = False


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


class RolloutWorker:
    """Runs one engine, built from ``engine_config`` for the module's ``policy`` and ``lora``, and
    scores its groups. Ray wraps this class as an actor."""

    def __init__(
        self, engine_config: Any, policy: Any, lora: Any, reward: Any, worker_index: int = 0
    ) -> None:
        self.engine = engine_config.build(policy, lora)
        self.reward = reward
        self.worker_index = worker_index

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
        if isinstance(named_tensors, dict):
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
        self.engine.close()


class PendingCall:
    """Non-blocking handle on one request spread over several workers (``ready/wait/result``)."""

    def __init__(self, refs: list[ray.ObjectRef], merge: Callable[[list[Any]], Any]) -> None:
        self._refs = refs
        self._merge = merge

    def ready(self) -> bool:
        done, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0, fetch_local=False)
        return len(done) == len(self._refs)

    def wait(self) -> None:
        ray.wait(self._refs, num_returns=len(self._refs), timeout=None)

    def result(self) -> Any:
        return self._merge(ray.get(self._refs))


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
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        ensure_ray()
        actor_cls = ray.remote(RolloutWorker).options(
            num_cpus=num_cpus_per_worker,
            num_gpus=num_gpus_per_worker,
            resources=resources_per_worker or {},
            runtime_env=runtime_env,
            max_concurrency=1,
        )
        _check_fits(num_workers, num_cpus_per_worker, num_gpus_per_worker, resources_per_worker or {})
        self.workers = [actor_cls.remote(engine_config, policy, lora, reward, i) for i in range(num_workers)]
        self.num_workers = num_workers
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

    def generate(self, request: RolloutRequest) -> PendingCall:
        parts = request.split(self.num_workers)
        refs = [worker.generate.remote(part) for worker, part in zip(self.workers, parts)]
        return PendingCall(refs, _merge_generate)

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every worker and wait for all answers."""
        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

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
