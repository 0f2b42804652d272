"""The rollout settings every strategy takes (:class:`RolloutSettings`, :class:`RewardWorkers`), their
checks, and the CPU-thread rule that splits a machine's cores between the trainer and the workers."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from unirl_lightning.core.checks import require_at_least, require_choice, require_positive
from unirl_lightning.core.preflight import (
    IN_PROCESS_PLACEMENTS,
    SHARED_DEVICE_PLACEMENTS,
    LaunchUnit,
    Placement,
    SyncMode,
    WorkerLayout,
    launch_unit_error,
    placement_schedule_error,
    sync_mode_placement_error,
)
from unirl_lightning.core.seeding import global_seed, rank_seed
from unirl_lightning.engines import check_engine_name

__all__ = [
    "Placement",
    "RewardWorkers",
    "RolloutSettings",
    "WorkerLayout",
    "check_rollout_settings",
    "cpu_threads",
    "rank_share",
]


def check_rollout_settings(
    placement: str, max_staleness: int, max_inflight: int, sync_mode: str = "quiesce"
) -> None:
    """The rules between rollout settings, checked once (the strategy and the CLI call this)."""
    require_choice("placement", placement, Placement)
    error = sync_mode_placement_error(sync_mode, placement)
    if error is not None:
        raise ValueError(error)
    require_at_least("max_staleness", max_staleness, 0)
    require_at_least("max_inflight", max_inflight, 1)
    error = placement_schedule_error(placement, max_staleness, max_inflight)
    if error is not None:
        raise ValueError(error)


@dataclass(frozen=True)
class RewardWorkers:
    """The strategy's ``reward_workers`` setting: a pool of Ray actors that score for this rank.

    Args:
        num_workers: reward actors per training rank (each rollout result goes to one, round robin).
        num_cpus_per_worker: Ray CPUs of each reward actor.
        num_gpus_per_worker: Ray GPUs of each (a share such as 0.5 lets two actors share a GPU; never
            a training GPU: a local Ray holds only the GPUs the training ranks leave).
        resources_per_worker: more Ray resources per actor (``{"reward_node": 1}``, ``{"node:<ip>": 0.01}``).
        timeout_s: how long one reward actor may take for a result of up to 1024 samples (a larger one
            gets proportionally longer); then it is replaced and the scoring relaunched.
    """

    num_workers: int = 1
    num_cpus_per_worker: float = 1
    num_gpus_per_worker: float = 0
    resources_per_worker: dict[str, float] | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        require_at_least("reward_workers.num_workers", self.num_workers, 1)
        require_at_least("reward_workers.num_cpus_per_worker", self.num_cpus_per_worker, 0)
        require_at_least("reward_workers.num_gpus_per_worker", self.num_gpus_per_worker, 0)
        require_positive("reward_workers.timeout_s", self.timeout_s)
        for key, amount in (self.resources_per_worker or {}).items():
            require_positive(f"reward_workers.resources_per_worker[{key!r}]", amount)


@dataclass(frozen=True, kw_only=True)
class RolloutSettings:
    """The strategy's rollout settings (its ``init_rollout`` arguments, documented there), checked
    once here and built by keyword; ``rank`` and ``worker_threads`` are filled in at setup."""

    engine: Any
    max_staleness: int
    max_inflight: int
    num_workers: int
    num_cpus_per_worker: float
    num_gpus_per_worker: float
    placement: Placement
    seed: int | None  # None: seed_everything's seed (global_seed), resolved when the record is built
    trainer_threads: int | None
    generation_timeout_s: float
    max_worker_restarts: int
    rank: int = 0
    worker_threads: int | None = None  # the CPU rule's share of each local worker (engines on "auto")
    worker_resources: dict[str, float] | None = None
    worker_layout: WorkerLayout = "actor"
    offload_optimizer: bool = False
    reward_workers: RewardWorkers | None = None  # None: the rollout workers score
    sync_mode: SyncMode = "quiesce"
    interrupt_chunk_tokens: int = 32
    launch_unit: LaunchUnit = "request"
    sync_interval: int = 1  # the weight-sync cadence (WeightSyncCallback's every_n_steps), filled at setup

    def __post_init__(self) -> None:
        if self.seed is None:
            object.__setattr__(self, "seed", global_seed())
        if isinstance(self.reward_workers, dict):  # a Python caller's plain dict
            object.__setattr__(self, "reward_workers", RewardWorkers(**self.reward_workers))
        check_rollout_settings(self.placement, self.max_staleness, self.max_inflight, self.sync_mode)
        require_at_least("interrupt_chunk_tokens", self.interrupt_chunk_tokens, 1)
        error = launch_unit_error(self.launch_unit, self.sync_mode)
        if error is not None:
            raise ValueError(error)
        if self.in_process and self.reward_workers is not None:
            raise ValueError(
                f"reward_workers run the reward on Ray actors, but placement={self.placement!r} runs without Ray "
                "(the reward runs in the training process): set reward_workers=None or placement='separate'"
            )
        if self.offload_optimizer and not (self.shares_trainer_device and not self.in_process):
            raise ValueError(
                "offload_optimizer=True moves the optimizer state to the host while colocated engines "
                f"use the training device, so it needs placement='colocate', got placement={self.placement!r}"
            )
        if isinstance(self.engine, str):
            check_engine_name(self.engine)
        require_at_least("num_workers", self.num_workers, 1)
        if self.in_process and self.num_workers != 1:
            raise ValueError(
                f"placement={self.placement!r} runs one engine in each training process: num_workers must "
                f"be 1, got num_workers={self.num_workers}"
            )
        require_at_least("max_worker_restarts", self.max_worker_restarts, 0)
        if self.trainer_threads is not None:
            require_at_least("trainer_threads", self.trainer_threads, 1)
        require_positive("generation_timeout_s", self.generation_timeout_s)
        require_choice("worker_layout", self.worker_layout, WorkerLayout)
        for key, amount in (self.worker_resources or {}).items():
            require_positive(f"worker_resources[{key!r}]", amount)
        gpus = float(self.num_gpus_per_worker)
        if self.worker_layout == "per_gpu" and not (gpus >= 2 and gpus.is_integer()):
            raise ValueError(
                f"worker_layout='per_gpu' needs a whole num_gpus_per_worker >= 2 (vLLM's tensor-parallel workers, "
                f"one per GPU), got {gpus:g}: with one GPU per worker use worker_layout='actor' (vLLM's "
                "single-process executor runs on the actor's first visible GPU, not on the one Ray reserved)"
            )

    @property
    def actor_gpus(self) -> float:
        """The GPUs a worker's actor process holds: all of its GPUs under ``worker_layout="actor"``, none
        under ``"per_gpu"`` (vLLM's own workers hold them)."""
        return float(self.num_gpus_per_worker) if self.worker_layout == "actor" else 0.0

    @property
    def shares_trainer_device(self) -> bool:
        """The engines run on the training device and take turns with training (``colocate``,
        ``hybrid``): they sleep while it trains, and a local Ray hides no training GPU from them."""
        return self.placement in SHARED_DEVICE_PLACEMENTS

    @property
    def in_process(self) -> bool:
        """The engine lives in the training process (``hybrid``): no Ray, an in-memory weight copy."""
        return self.placement in IN_PROCESS_PLACEMENTS

    @property
    def synchronous(self) -> bool:
        """Generation and training take turns (nothing overlaps): ``max_inflight=1, max_staleness=0``."""
        return self.max_inflight == 1 and self.max_staleness == 0

    def cpu_threads(self, world_size: int, num_nodes: int) -> dict[str, int]:
        """:func:`cpu_threads` for a run of ``world_size`` ranks on ``num_nodes`` nodes, whose local
        workers are this node's unless Ray is a joined cluster (``RAY_ADDRESS``). An in-process
        engine (``hybrid``) runs on its rank's threads."""
        local_ranks = max(1, world_size // max(1, num_nodes))
        if self.in_process:
            threads = self.trainer_threads or max(1, (os.cpu_count() or 1) // local_ranks)
            return {"trainer": threads, "worker": threads}
        local_workers = 0 if os.environ.get("RAY_ADDRESS") else local_ranks * self.num_workers
        return cpu_threads(
            os.cpu_count() or 1, local_ranks, local_workers, self.synchronous, self.num_cpus_per_worker
        )

    @property
    def rank_seed(self) -> int:
        """The base seed of this rank's agentic episodes (each turn's seed is a hash of its episode's,
        ``seeding.turn_seed``); batch requests are seeded ``derive_seed(seed, rank, gen_id)``."""
        return rank_seed(self.seed, self.rank)


def rank_share(state: dict[str, Any], world_size: int, rank: int) -> dict[str, Any]:
    """``rank``'s part of a checkpoint's rollout state (``{"world_size": W, "ranks": [...]}``; a single
    rank's state is accepted as is); a checkpoint of another number of ranks is refused."""
    if "ranks" not in state:
        return dict(state)
    if state["world_size"] != world_size:
        raise ValueError(
            f"the checkpoint was written by {state['world_size']} training rank(s) and this run has "
            f"{world_size}: resume with the same number of ranks (each rank's prompt stream and "
            "in-flight requests are its own)"
        )
    return dict(state["ranks"][rank])


def cpu_threads(
    cores: int,
    local_ranks: int,
    local_workers: int,
    synchronous: bool,
    num_cpus_per_worker: float,
) -> dict[str, int]:
    """The CPU rule: cores on this node for the trainer (per local rank) and for each local worker.

    Synchronous runs take turns, so the side that is working gets every core (the idle side's
    threads sleep). Async runs overlap: each local worker keeps ``ceil(num_cpus_per_worker)``
    cores and the trainers share the rest (at least 1 each). With no local worker (``RAY_ADDRESS``:
    the workers live elsewhere) the trainers take the node.

    >>> cpu_threads(8, 1, 2, synchronous=False, num_cpus_per_worker=1)
    {'trainer': 6, 'worker': 1}
    >>> cpu_threads(8, 1, 2, synchronous=True, num_cpus_per_worker=1)
    {'trainer': 8, 'worker': 4}
    """
    local_ranks = max(1, local_ranks)
    if synchronous or not local_workers:
        return {"trainer": max(1, cores // local_ranks), "worker": max(1, cores // max(1, local_workers))}
    per_worker = max(1, math.ceil(num_cpus_per_worker))
    return {"trainer": max(1, (cores - local_workers * per_worker) // local_ranks), "worker": per_worker}
