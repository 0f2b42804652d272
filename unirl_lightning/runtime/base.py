"""The rollout runtime: one family's rollout side, behind the small interface the strategy calls.

Who calls it
    The strategy (:class:`~unirl_lightning.strategy.RolloutStrategyMixin`), from Lightning's hooks:
    ``start`` at setup, ``make_loop`` for the training dataloader, ``resolve`` at ``batch_to_device``,
    ``sync_weights`` from the sync verb, ``evaluate``, ``state_dict`` / ``load_state_dict`` for
    checkpoints, ``shutdown`` at teardown. The strategy never asks which family it runs.

What a runtime owns
    Its workers (a :class:`~unirl_lightning.workers.group.RolloutWorkerGroup` of its actor class),
    its controller (version ledger, in-flight bookkeeping, buffers) and its loop (the training
    policy of ``rollout/``, which stays standard-library only), its evaluation, its rollout state,
    its engine default and its family checks. A new family adds a runtime, not branches.

Guarantees (every family)
    The workers start from the trainer's weights at the current version (no bump); a replaced
    worker gets the current weights before its lost requests run again; :meth:`sync_weights`
    quiesces (waits for or aborts everything in flight; with ``sync_mode="continue"`` generation goes
    on through the push, on an engine that loads between decode steps), pushes and advances the
    version once;
    evaluation never pushes and never changes the version.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, ClassVar

from unirl_lightning.core.timeline import Timeline
from unirl_lightning.engines import EngineConfig, resolve_engine
from unirl_lightning.runtime.devices import (
    OffloadedState,
    free_trainer_memory,
    gather_objects,
    optimizers_to_device,
    optimizers_to_host,
    policy_device,
    trainer_row,
)
from unirl_lightning.runtime.settings import (
    Placement,
    RewardWorkers,
    RolloutSettings,
    WorkerLayout,
    check_rollout_settings,
    cpu_threads,
    rank_share,
)

__all__ = [
    "Placement",
    "RolloutRuntime",
    "RolloutSettings",
    "RewardWorkers",
    "WorkerLayout",
    "check_rollout_settings",
    "cpu_threads",
    "free_trainer_memory",
    "optimizers_to_device",
    "optimizers_to_host",
    "rank_share",
]


class RolloutRuntime:
    """Base of the family runtimes (see the module docstring); a subclass supplies its controller
    (:meth:`_make_controller`), its loop (:meth:`make_loop`) and its evaluation (:meth:`evaluate`).

    Args:
        spec: the module's :class:`~unirl_lightning.modules.base.RolloutSpec`.
        settings: the strategy's rollout settings.
        weight_sync: the weight-sync backend (``push(model, workers, version)``).
        state: a checkpoint's rollout state for this rank (:meth:`load_state_dict`), or None.
    """

    default_engines: ClassVar[dict[str, str]] = {"token": "hf", "diffusion": "diffusion"}
    """``engine="auto"``: the engine each policy family is served with by default."""
    shardable_families: ClassVar[tuple[str, ...]] = ("token",)
    """The policy families whose modules shard their networks (FSDP2 ``configure_model``)."""

    def __init__(
        self, spec: Any, settings: RolloutSettings, weight_sync: Any, state: dict[str, Any] | None = None
    ) -> None:
        self.spec = spec
        self.settings = settings
        self.weight_sync = weight_sync
        self.workers: Any = None
        self.reward_pool: Any = None  # a RewardWorkerPool when settings.reward_workers is set
        self.controller: Any = None
        self.loop: Any = None
        self._policy: Any = None  # the trainer's policy module, pushed at start, sync and replacement
        self._state: dict[str, Any] = dict(state or {})  # a checkpoint's, applied when the loop is built
        self.timeline = Timeline(rank=settings.rank)  # this rank's spans (the loop and sync record them)
        self._offloaded: OffloadedState = []  # optimizer state on the host while colocated engines wake
        self.eval_reward_timeouts = 0  # answer checks evaluation's scoring gave up on, since start

    # -- checks before anything starts ------------------------------------------------------------
    def check(self) -> None:
        """This family's rules between the module and the settings (``ValueError`` naming the keys)."""

    @classmethod
    def check_shardable(cls, spec: Any, module_name: str) -> None:
        if spec.family not in cls.shardable_families:
            raise ValueError(
                f"AsyncRolloutFSDPStrategy shards LLM modules (GRPOModule, PPOModule, AgenticGRPOModule); "
                f"{module_name} is not one: train it with AsyncRolloutStrategy or AsyncRolloutDDPStrategy"
            )

    def engine_config(self) -> EngineConfig:
        spec, settings = self.spec, self.settings
        engine = resolve_engine(settings.engine, self.default_engines[spec.family], spec.family)
        engine.validate(spec.policy, spec.lora)
        if settings.worker_threads is not None:
            engine = engine.with_cpu_threads(settings.worker_threads)
        return engine.for_placement(settings)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, policy: Any, before_push: Callable[[], None] | None = None) -> None:
        """Start the workers and the controller, run ``before_push`` (the strategy's placement report,
        whose overlap check must fail readably before a push can fail inside NCCL), and push the
        trainer's weights at the current version (a resumed ledger's, when a checkpoint was loaded
        before)."""
        from unirl_lightning.workers.factory import WorkerGroupSpec, worker_group_class

        self.check()
        spec, settings = self.spec, self.settings
        if settings.reward_workers is not None and self.reward_pool is None:  # the reward on its own actors
            from unirl_lightning.workers.reward import RewardWorkerPool

            self.reward_pool = RewardWorkerPool(
                spec.reward, settings.reward_workers, max_restarts=settings.max_worker_restarts
            )
        engine = self.engine_config()
        if settings.in_process and hasattr(engine, "device"):  # the engine works on the trainer's device
            engine = dataclasses.replace(engine, device=str(policy_device(policy)))
        self.workers = worker_group_class(settings.placement).from_spec(
            WorkerGroupSpec(
                engine,
                spec.policy,
                spec.lora,
                reward=None if self.reward_pool is not None else spec.reward,
                reward_pool=self.reward_pool,
                worker_cls=self.actor_class(),
                num_workers=settings.num_workers,
                num_cpus_per_worker=settings.num_cpus_per_worker,
                num_gpus_per_worker=settings.num_gpus_per_worker,
                resources_per_worker=settings.worker_resources,
                layout=settings.worker_layout,
                generation_timeout_s=settings.generation_timeout_s,
                max_restarts=settings.max_worker_restarts,
                shares_trainer_device=settings.shares_trainer_device,
                share_weights=settings.sync_interval == 1,
            )
        )
        self.workers.on_restart = self._push_to_replacement
        self._policy = policy
        self.controller = self._make_controller(self._state)
        if before_push is not None:
            before_push()
        self.weight_sync.push(policy, self.workers, self.controller.weight_version)

    def report_placement(self, trainer: Any) -> dict[str, Any]:
        """Where every training rank and worker runs, gathered from every rank (collective: each rank
        calls it at the same point of setup); rank 0 writes ``placement.json`` into the run's log
        folder (``trainer.log_dir``, when there is a logger) and prints the table. With
        ``placement="separate"`` a worker on a GPU a training rank holds (same node) is an error
        naming the overlap."""
        from lightning.pytorch.utilities import rank_zero_info

        from unirl_lightning.workers.placement import find_overlaps, placement_report

        rank, world_size = self.settings.rank, trainer.world_size
        folder = trainer.log_dir if trainer.loggers else None  # a collective too (a broadcast)
        mine = {
            "trainer": trainer_row(rank, trainer.strategy.root_device),
            "workers": [{"rank": rank, **w} for w in self.workers.call("placement_info", timeout_s=60)],
            "reward_workers": [
                {"rank": rank, **w}
                for w in (self.reward_pool.call("placement_info", timeout_s=60) if self.reward_pool else [])
            ],
        }
        every = gather_objects(mine, world_size)
        trainers, workers = [e["trainer"] for e in every], [w for e in every for w in e["workers"]]
        scorers = [w for e in every for w in e["reward_workers"]]
        if rank == 0:
            rank_zero_info("Rollout placement:\n" + placement_report(trainers, workers, folder, scorers))
        overlaps = find_overlaps(trainers, workers, scorers)
        scoring_overlaps = find_overlaps(trainers, [], scorers)
        if scoring_overlaps:  # whatever the placement: a reward model never shares a training GPU
            raise RuntimeError(
                "reward workers were given GPUs the training ranks use: "
                + "; ".join(scoring_overlaps)
                + ". Start Ray on the spare GPUs only (docs/gpus.md), or pin them elsewhere with "
                "reward_workers.resources_per_worker"
            )
        if overlaps and not self.settings.shares_trainer_device:
            raise RuntimeError(
                "rollout or reward workers were given GPUs the training ranks use (placement='separate'): "
                + "; ".join(overlaps)
                + ". Start Ray on the spare GPUs only (docs/gpus.md), or use placement='colocate'"
            )
        return {"trainers": trainers, "workers": workers, "reward_workers": scorers, "overlaps": overlaps}

    def actor_class(self) -> type:
        """The Ray actor class of this family's workers."""
        from unirl_lightning.workers.actor import RolloutWorker

        return RolloutWorker

    def _make_controller(self, state: dict[str, Any]) -> Any:  # pragma: no cover - abstract
        """The family's controller, resuming the version ledger of a checkpoint's loop ``state``."""
        raise NotImplementedError

    def _push_to_replacement(self, index: int) -> None:
        """A replaced worker starts from the weights of the current version, labelled with it: the
        backend's last push re-sent when it can (``resend``: the object store keeps it), else a fresh
        push of the trainer's weights (fresher in async runs, never older). No sync has happened since
        the lost requests were launched, so their stamp stays an upper bound on their staleness.

        This runs on one rank alone, so it must enter no collective: a model sharded over several
        ranks is never read here (gathering it needs every rank); without a re-sendable push that is
        an error naming the fix, never a hang."""
        self.timeline.instant("worker_restart", cat="fault", worker=index)
        subset = self.workers.subset([index])
        version = self.controller.weight_version
        resend = getattr(self.weight_sync, "resend", None)
        if resend is not None and resend(subset, version) is not None:
            return
        import torch.distributed as dist

        from unirl_lightning.distributed.sharding import is_sharded
        from unirl_lightning.weight_sync.base import weight_tensors

        several_ranks = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if several_ranks and any(is_sharded(t) for t in weight_tensors(self._policy).values()):
            raise RuntimeError(
                f"rollout worker {index} was replaced, and the weights of version {version} cannot be "
                f"sent to it without gathering the sharded model, a collective the other ranks are not "
                f"in ({type(self.weight_sync).__name__} kept no push of that version): use "
                "weight_sync='object_store' (it re-sends its last push), or max_worker_restarts=0"
            )
        self.weight_sync.push(self._policy, subset, version)

    def stats(self) -> dict[str, float]:
        """Per-step figures of the runtime itself (added to every batch's ``stats``)."""
        stats = {"rollout/worker_restarts": float(self.workers.restarts)}
        if self.reward_pool is not None:
            stats["rollout/reward_worker_restarts"] = float(self.reward_pool.restarts)
        return stats

    def make_loop(self, dataloader: Any, sync_interval: int) -> Any:  # pragma: no cover - abstract
        """The loop Lightning iterates in place of the prompt ``dataloader`` (a checkpoint's
        position, when one was loaded, is restored into it)."""
        raise NotImplementedError

    def _restore(self, loop: Any) -> Any:
        if self._state:
            loop.load_loop_state(self._state)
            self._state = {}
        loop.timeline = self.timeline
        self.loop = loop
        return loop

    def resolve(self, batch: Any, optimizers: Any = ()) -> Any:
        """The loop's deferred batch, resolved now (after the previous step's sync); with
        engines on the trainer's device (``shares_trainer_device``: colocate, hybrid) the engines then
        sleep, so the trainer has the device, and with ``offload_optimizer`` the state of
        ``optimizers`` (the strategy's) goes back to it."""
        batch = batch.resolve()
        if self.workers.shares_trainer_device:  # nothing is in flight (synchronous)
            self.workers.call("sleep")
            if self.settings.offload_optimizer:
                optimizers_to_device(self._offloaded)
                self._offloaded = []
        return batch

    # -- the sync verb ----------------------------------------------------------------------------
    def sync_weights(
        self, policy: Any, optimizers: Any = (), after_quiesce: Callable[[], None] | None = None
    ) -> dict[str, float]:
        """Quiesce, push ``policy``'s weights to every worker, advance the version (one rank's part
        of a collective sync: the strategy's barrier ends it). ``after_quiesce`` runs between the two
        (the strategy's barrier: no rank starts a push, whose gather of a sharded model is a
        collective, while another still waits for its generation). With engines on the trainer's device the
        trainer first frees its cached blocks (and, with ``offload_optimizer``, moves the state of
        ``optimizers`` to the host); the engines then wake in two phases: weights, push, KV cache."""
        ctl = self.controller
        in_place = self.settings.sync_mode == "continue"  # generation goes on through the push
        start = time.perf_counter()
        with self.timeline.measure("sync/quiesce", cat="sync", version=ctl.weight_version):
            if in_place:
                ctl.poll()  # reap what finished; the rest goes on through the push
            else:
                self._quiesce(ctl)
        quiesce_s = time.perf_counter() - start
        if self.loop is not None:
            self.loop.blocked_s += quiesce_s  # generation the trainer waited for was not hidden
        if after_quiesce is not None:
            after_quiesce()
        ctl.require_idle(in_place)  # a generation straddles two versions only token by token, in place
        self.workers.ensure_alive(min(30.0, self.settings.generation_timeout_s))  # nothing in flight
        version = ctl.weight_version + 1
        colocate = self.workers.shares_trainer_device
        if colocate:  # make room on the shared device, then wake the weights for the push
            if self.settings.offload_optimizer:
                self._offloaded += optimizers_to_host(optimizers)
            free_trainer_memory(policy_device(policy))
            self.workers.call("wake", ["weights"])
        with self.timeline.measure("sync/push", cat="sync", version=version):
            result = self.weight_sync.push(policy, self.workers, version)
        if colocate:  # the KV cache for the next generation
            self.workers.call("wake", ["kv_cache"])
        version = ctl.advance_version(in_place)  # only after the push succeeded
        self._after_push(ctl)
        return {
            "sync/time_s": result.time_s,
            "sync/bytes": float(result.bytes),
            "sync/quiesce_s": quiesce_s,
            "sync/weight_version": float(version),
        }

    def _quiesce(self, controller: Any) -> None:
        """Empty the in-flight pool before a push (a family that interrupts overrides it)."""
        controller.quiesce()

    def _after_push(self, controller: Any) -> None:
        """Run right after the push advanced the version (resume what ``_quiesce`` interrupted)."""

    @property
    def weight_version(self) -> int:
        return self.controller.weight_version if self.controller is not None else 0

    def evaluate(
        self, records: list[dict[str, Any]], sampling: Any, n: int, seed: int
    ) -> list[list[Any]]:  # pragma: no cover - abstract
        """Generate and score ``records`` with the weights the workers hold now (read-only)."""
        raise NotImplementedError

    # -- rollout state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's loop position and version ledger (plain Python types)."""
        if self.loop is not None:
            return self.loop.loop_state()
        return dict(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's rollout state for this rank, applied when the loop is built."""
        self._state = dict(state)

    def shutdown(self) -> None:
        """Kill the workers (safe to call twice); the state for a next start is kept."""
        if self.workers is not None:
            self.workers.shutdown()
        if self.reward_pool is not None:
            self.reward_pool.shutdown()
        self.workers = None
        self.reward_pool = None
        self.controller = None
        self.loop = None
