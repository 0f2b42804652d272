"""Ray's lifecycle for a run: join a cluster or start a local one, and stop only what we started.

Contract:

* :func:`ensure_ray` joins the cluster named by ``RAY_ADDRESS`` or starts a local Ray on demand
  (and only then owns it: :func:`shutdown_ray_if_owned` stops it). A local Ray lives in a temp
  folder of its own, removed at shutdown, and a watchdog process
  (:mod:`unirl_lightning.workers.watchdog`) ends every process of it within a second or so of the
  driver's death, SIGKILL included.
* A local Ray started for training ranks on GPUs (``trainer_devices``) sees only the GPUs none of
  them uses (:func:`~unirl_lightning.workers.placement.local_ray_gpus`), and fails at once when
  the workers ask for more; a joined cluster (``RAY_ADDRESS``, or a Ray already running) is left as
  it is. Whether workers fit is checked against the resources Ray has free, by the worker group
  (:func:`~unirl_lightning.workers.placement.check_free`).
* Every worker this library starts (rollout, reward) runs at the driver's scheduling priority:
  :func:`worker_runtime_env` sets ``RAY_worker_niceness`` (Ray starts its workers at ``nice 15``
  by default, so any process of normal priority on the node, a trainer rank included, preempts
  them; a worker's multi-threaded torch then waits at every OpenMP barrier for a descheduled
  thread: measured 5-18x slower 2-thread matrix products on a loaded 2-core node).
  ``RAY_worker_niceness`` set in the driver's
  environment is passed on instead. A worker whose engine sets its torch threads also starts with
  ``OMP_NUM_THREADS`` at that count (:func:`worker_runtime_env`).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import psutil
import ray

from unirl_lightning.workers.placement import local_ray_gpus, only_gpus, visible_gpu_ids
from unirl_lightning.workers.watchdog import start_watchdog, stop_watchdog

__all__ = ["connect_ranks", "ensure_ray", "shutdown_ray_if_owned", "worker_runtime_env"]

WORKER_NICENESS = 0  # the driver's default priority; Ray's own default for workers is 15

_STARTED_BY_US = False
_OWNED: dict[str, Any] = {}  # the local Ray's temp folder and watchdog, when this process started it


def worker_runtime_env(runtime_env: dict[str, Any] | None = None, threads: Any = None) -> dict[str, Any]:
    """``runtime_env`` (a Ray runtime environment, or None) with ``RAY_worker_niceness`` among its
    ``env_vars``: ``WORKER_NICENESS``, or the driver's ``RAY_worker_niceness`` when set; and, given a
    worker's torch thread count ``threads`` (a positive int), ``OMP_NUM_THREADS`` set to it (Ray sets
    it to the actor's ``num_cpus``, 1 by default, and an OpenMP runtime started at 1 thread runs a
    later ``torch.set_num_threads(2)`` about 40 % slower on small products than one started at 2).
    The driver's ``NCCL_CUMEM_ENABLE``, when set, is passed on (NCCL peers of a collective push must
    agree on it). A value the caller's ``env_vars`` already hold is kept."""
    env = dict(runtime_env or {})
    env_vars = dict(env.get("env_vars") or {})
    env_vars.setdefault("RAY_worker_niceness", os.environ.get("RAY_worker_niceness", str(WORKER_NICENESS)))
    if "NCCL_CUMEM_ENABLE" in os.environ:  # NCCL peers must agree on it (device_rules.nccl_cumem_setting)
        env_vars.setdefault("NCCL_CUMEM_ENABLE", os.environ["NCCL_CUMEM_ENABLE"])
    if isinstance(threads, int) and not isinstance(threads, bool) and threads > 0:
        env_vars.setdefault("OMP_NUM_THREADS", str(threads))
    env["env_vars"] = env_vars
    return env


def ensure_ray(
    num_cpus: int | None = None,
    object_store_memory: int | None = None,
    trainer_devices: Sequence[Any] | None = None,
    asked_gpus: float = 0.0,
) -> None:
    """Join ``RAY_ADDRESS`` if set, else start a local Ray unless one is running already. With
    ``trainer_devices`` (this node's training devices) a local Ray gets only the GPUs they leave
    (all visible GPUs when None), and fails when the workers ask for more (``asked_gpus``).

    The local object store holds every weight push (each tensor of a model as its own object), so
    by default it takes 30% of the memory up to 4 GiB: a push larger than the store falls back to
    disk (measured: a 538 MB push took 0.7-2.7 s with a 512 MB store, 0.05-0.46 s with 2 GiB)."""
    global _STARTED_BY_US
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    gpus = None if trainer_devices is None else _spare_gpus(trainer_devices, asked_gpus)
    if object_store_memory is None:
        object_store_memory = min(4 * 1024**3, int(0.3 * psutil.virtual_memory().total))
    # a short folder of its own (Ray's socket paths must stay under 108 bytes), removed at shutdown
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
    spared = [p.pid for p in psutil.Process().children(recursive=True)]  # e.g. other training ranks
    with nullcontext() if gpus is None else only_gpus(gpus):  # the raylet keeps the variable
        _init_local(num_cpus, object_store_memory, temp_dir, None if gpus is None else len(gpus))
    _STARTED_BY_US = True
    _OWNED.update(temp_dir=temp_dir, watchdog=start_watchdog(temp_dir, spared))


def _spare_gpus(trainer_devices: Sequence[Any], asked_gpus: float) -> list[str] | None:
    """The GPU ids a local Ray may hand out; None on a machine without GPUs (nothing to hide)."""
    import torch

    visible, count = os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count()
    spare = local_ray_gpus(trainer_devices, asked_gpus, visible, count)
    return spare if visible_gpu_ids(visible, count) else None


def _init_local(num_cpus: int | None, object_store_memory: int, temp_dir: str, num_gpus: int | None) -> None:
    ray.init(
        num_cpus=num_cpus or max(2, os.cpu_count() or 1),
        num_gpus=num_gpus,
        object_store_memory=object_store_memory,
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=True,
        logging_level=logging.WARNING,
        _temp_dir=temp_dir,
    )


def connect_ranks(
    rank: int,
    num_cpus: int,
    broadcast: Callable[..., Any],
    trainer_devices: Sequence[Any] | None = None,
    asked_gpus: float = 0.0,
) -> None:
    """One Ray for the training ranks (one or several): rank 0 starts (or joins) it with at least
    ``num_cpus`` CPUs and, when it starts it, only the GPUs ``trainer_devices`` leave (see
    :func:`ensure_ray`), and broadcasts its address (``broadcast(obj, src=0)``, the strategy's); the
    others join it."""
    address = None
    if rank == 0:
        ensure_ray(max(num_cpus, os.cpu_count() or 1), None, trainer_devices, asked_gpus)
        address = ray.get_runtime_context().gcs_address
    address = broadcast(address, src=0)
    if rank == 0 or ray.is_initialized():
        return
    # an explicit address authenticates only when token auth was on before ray was imported
    # (the CLI and the tests set RAY_AUTH_MODE=token); otherwise "auto" finds this node's cluster
    explicit = os.environ.get("RAY_ADDRESS") or (
        address if os.environ.get("RAY_AUTH_MODE") == "token" else None
    )
    ray.init(address=explicit or "auto", log_to_driver=True)
    if ray.get_runtime_context().gcs_address != address:
        raise RuntimeError(
            f"rank {rank} joined the Ray cluster at {ray.get_runtime_context().gcs_address}, but rank 0 runs one "
            f"at {address}: set RAY_AUTH_MODE=token (or RAY_ADDRESS) before the run starts"
        )


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
