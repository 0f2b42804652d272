"""The hybrid engine: one rollout worker inside the training process, behind the worker group's interface.

Contract:

* :class:`InProcessWorkerGroup` takes the Ray group's constructor arguments and has its interface
  (``generate`` returning a ready/wait/result handle, ``call``, ``subset``, ``ensure_alive``,
  ``replace``, ``shutdown``, ``connect`` / ``leave`` / ``release``), so the rollout runtime, the
  controller, the loop, the version stamps, evaluation and checkpoints are the same as with Ray
  workers. It holds one :class:`~unirl_lightning.workers.actor.RolloutWorker` (the same class the
  Ray actors run: engine and reward) as a plain object, on the training device; this module never
  imports ``ray``.
* Generation runs in the caller's thread when :meth:`InProcessWorkerGroup.generate` is called (the
  placement is synchronous: ``max_staleness=0, max_inflight=1``); the handle is ready at once, and
  ``result()`` returns the groups or raises the call's error (again on a retry). Rewards are scored
  in the training process, right after generation, as a Ray worker scores them.
* The engine's random numbers (its model's construction, sampling, vLLM's seeding at start) are
  drawn from forked torch generator states, and Python's and NumPy's global states are put back
  after each engine call, so the trainer's random streams are the same as with Ray workers.
* Weights reach the engine through :class:`~unirl_lightning.weight_sync.inprocess.InProcessWeightSync`:
  with ``share_weights`` (a sync after every step) an engine that can (HF) reads the trainer's own
  tensors where dtype, device and shape agree (no copy), else a cast copy, bucket by bucket.
* A fault in the engine is a fault of the training process: nothing is replaced (``max_restarts``
  is 0, :meth:`InProcessWorkerGroup.replace` raises naming the worker), and the error ends the run.
* With several training ranks (DDP, FSDP) each rank has an engine of its own, as TRL's colocate mode.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from unirl_lightning.rollout.records import GenerationResult, RolloutRequest
from unirl_lightning.workers.actor import RolloutWorker
from unirl_lightning.workers.calls import CallPart, WorkerSubset, merge_results
from unirl_lightning.workers.factory import WorkerGroupSpec
from unirl_lightning.workers.placement import local_node_ip

__all__ = ["InProcessCall", "InProcessWorkerGroup"]

log = logging.getLogger(__name__)


def _numpy_random() -> Any:
    """``numpy.random``, or None without NumPy."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random


class InProcessCall:
    """The handle of one in-process generation (already done): ``ready()`` is True, ``wait()``
    returns, ``result()`` returns the merged result or raises the generation's error (each call)."""

    def __init__(self, result: GenerationResult | None, error: BaseException | None) -> None:
        self._result = result
        self._error = error

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        """Nothing to wait for: the generation ran when it was launched."""

    def result(self) -> GenerationResult:
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class InProcessWorkerGroup:
    """One engine in the training process (``placement="hybrid"``); see the module docstring.

    Args:
        engine_config / policy / lora: what the engine serves (``engine_config.build(policy, lora)``,
            on the training device: the runtime sets the engine's ``device``).
        reward: scores each sample, in this process.
        worker_cls: the worker class (:class:`~unirl_lightning.workers.actor.RolloutWorker`).
        share_weights: the weight sync may hand the engine the trainer's own tensors (no copy): only
            when every step is followed by a sync, so that the engine never generates with
            weights of a version it was not given.
        generation_timeout_s: the deadline a caller reads (``deadline_s``); nothing waits on it here.
        num_workers: must be 1 (one engine per training rank).
        reward_pool: must be None (the reward runs in this process).

    A :class:`~unirl_lightning.workers.factory.WorkerGroupSpec`'s Ray resources, layout and restarts
    mean nothing here: ``from_spec`` reads the fields above only. The group is always on the trainer's
    device (``shares_trainer_device``) and never replaces its engine (``max_restarts`` 0).

    Example::

        group = InProcessWorkerGroup(HFEngineConfig(device="cpu"), TinyCausalLM(), reward=ExactMatchReward())
        groups = group.generate(RolloutRequest(records, n=8)).result().groups
    """

    def __init__(
        self,
        engine_config: Any,
        policy: Any,
        lora: Any = None,
        reward: Any = None,
        *,
        worker_cls: type = RolloutWorker,
        share_weights: bool = True,
        generation_timeout_s: float = 600.0,
        num_workers: int = 1,
        reward_pool: Any = None,
    ) -> None:
        if reward_pool is not None:  # RolloutSettings refuses reward_workers with hybrid
            raise ValueError("placement='hybrid' scores in the training process: it takes no reward_workers")
        if num_workers != 1:
            raise ValueError(
                f"placement='hybrid' runs one engine in each training process: num_workers must be 1, "
                f"got {num_workers}"
            )
        self.num_workers = 1
        self.shares_trainer_device = True
        self.share_weights = bool(share_weights)
        self.max_restarts = 0
        self.restarts = 0
        self.on_restart: Callable[[int], None] | None = None  # never called: nothing is replaced
        self.generation_timeout_s = generation_timeout_s
        self._device = getattr(engine_config, "device", "cpu")
        with self.engine_rng():
            self.workers = [worker_cls(engine_config, policy, lora, reward, 0)]
        # an engine whose config names no device says where it runs (vLLM: its worker's device)
        self._device = str(getattr(self.workers[0].engine, "device", self._device))

    @classmethod
    def from_spec(cls, spec: WorkerGroupSpec) -> InProcessWorkerGroup:
        """The group a runtime asks for, from the fields that mean something in-process."""
        return cls(
            spec.engine_config,
            spec.policy,
            spec.lora,
            spec.reward,
            worker_cls=spec.worker_cls or RolloutWorker,
            share_weights=spec.share_weights,
            generation_timeout_s=spec.generation_timeout_s,
            num_workers=spec.num_workers,
            reward_pool=spec.reward_pool,
        )

    @contextlib.contextmanager
    def engine_rng(self) -> Iterator[None]:
        """Run the engine on a fork of torch's generators (CPU, and the engine's CUDA device) and of
        Python's and NumPy's global ones (vLLM seeds all of them when it starts in this process): what
        it draws or seeds does not move the trainer's random streams."""
        import random

        import torch

        devices: list[Any] = []
        if str(self._device).startswith("cuda") and torch.cuda.is_available():
            index = torch.device(self._device).index
            devices = [torch.cuda.current_device() if index is None else index]
        elif torch.cuda.is_available() and torch.cuda.is_initialized():  # vLLM on the current device
            devices = [torch.cuda.current_device()]
        python_state = random.getstate()
        numpy_random = _numpy_random()
        numpy_state = numpy_random.get_state() if numpy_random is not None else None
        try:
            with torch.random.fork_rng(devices=devices):
                yield
        finally:
            random.setstate(python_state)
            if numpy_random is not None:
                numpy_random.set_state(numpy_state)

    # -- what a run's processes share (nothing: no Ray) -----------------------------------------
    @classmethod
    def connect(
        cls,
        rank: int,
        world_size: int,
        settings: Any,
        trainer_devices: Sequence[Any],
        broadcast: Callable[..., Any],
    ) -> None:
        """Nothing to connect: the engine is in this process."""

    @classmethod
    def leave(cls, rank: int) -> None:
        """Nothing to leave."""

    @classmethod
    def release(cls) -> None:
        """Nothing to stop."""

    # -- the worker group's interface -----------------------------------------------------------
    def deadline_s(self, request: RolloutRequest) -> float:
        """Unused here (a call returns when done); kept for the interface."""
        samples = len(request.records) * request.n
        return self.generation_timeout_s * max(1.0, samples / 1024)

    def generate(self, request: RolloutRequest) -> InProcessCall:
        """Generate and score ``request`` now, in this process; the handle is ready at once."""
        worker = self._worker()
        launched_at, started = time.time(), time.monotonic()
        try:
            with self.engine_rng():
                part = worker.generate(request)
        except Exception as exc:  # noqa: BLE001 - the controller reaps it: result() raises it
            return InProcessCall(None, exc)
        call = CallPart(0, request, worker, None, started, done=True, launched_at=launched_at)
        call.reaped_at = time.time()
        return InProcessCall(merge_results([part], [call]), None)

    def call(self, method: str, *args: Any, timeout_s: float | None = 600.0, **kwargs: Any) -> list[Any]:
        """Call ``method`` on the worker (in this process) and return ``[answer]``."""
        if method == "placement_info":
            return [self.placement_info()]
        return [getattr(self._worker(), method)(*args, **kwargs)]

    def placement_info(self) -> dict[str, Any]:
        """Where the engine runs: this process, on the training device."""
        return {
            "worker": 0,
            "node_id": "",
            "node_ip": local_node_ip(),
            "pid": os.getpid(),
            "gpu_ids": [],  # the trainer's device, reported on the trainer's row
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "placement_group": None,
            "in_process": True,
            "device": str(self._device),
        }

    def subset(self, indices: list[int]) -> WorkerSubset:
        """A view of the worker (index 0), for a weight push."""
        return WorkerSubset([self.workers[i] for i in indices])

    def ensure_alive(self, timeout_s: float = 30.0) -> None:
        """Nothing to check: the engine lives as long as this process (a failure raises in the call)."""
        self._worker()

    def replace(self, index: int, actor: Any, why: str) -> None:
        """Never possible: the engine is part of the training process."""
        raise RuntimeError(
            f"the in-process rollout engine {index} {why}; placement='hybrid' cannot replace it (it is part "
            "of the training process): fix the cause, or use placement='separate' for replaceable workers"
        )

    def shutdown(self) -> None:
        """Close the engine (safe to call twice)."""
        workers, self.workers = getattr(self, "workers", []), []
        for worker in workers:
            try:
                worker.close()
            except Exception:  # noqa: BLE001 - best effort at teardown
                log.warning("closing the in-process engine failed", exc_info=True)

    def _worker(self) -> RolloutWorker:
        if not self.workers:
            raise RuntimeError("the in-process rollout engine was shut down")
        return self.workers[0]
