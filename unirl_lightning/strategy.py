"""AsyncRolloutStrategy: Lightning's training strategy plus the rollout side of an RL loop.

The module says *what* is learned (its :class:`~unirl_lightning.modules.base.RolloutSpec`: policy
spec, LoRA, reward, sampling, group size); the strategy says *where and how* it runs: which engine
serves the policy (``engine``), on how many Ray workers with which resources, placed how, and how
weights travel (``weight_sync``). Serving the same module with vLLM instead of HF is a change of
strategy only.

What it owns (built once, kept across repeated ``fit``/``validate`` calls on the same strategy):
the rollout workers (Ray actors running the engine), the driver-side
:class:`~unirl_lightning.rollout.controller.BatchRolloutController` (version ledger, buffers) and
the weight-sync backend. For the training stage only it replaces the prompt dataloader with a
:class:`~unirl_lightning.rollout.loop.RolloutLoop` through ``process_dataloader``, so
``training_step`` receives the module's batches. A module whose rollout spec is agentic gets an
:class:`~unirl_lightning.rollout.agentic.AgenticRolloutController` over the workers' episode
coordinators and an :class:`~unirl_lightning.rollout.agentic_loop.AgenticRolloutLoop` instead. Its rollout state (the loop's position and the
version ledger) goes into every checkpoint through ``save_checkpoint`` / ``load_checkpoint``.

Guarantees: ``max_staleness=0, max_inflight=1`` is synchronous on-policy training; no trained
sample is older than ``max_staleness`` versions; weights are pushed only while nothing is in flight
(:meth:`sync_weights` quiesces first); evaluation never pushes and never changes the version.
Workers are shut down on error and Ctrl-C (``on_exception``), by :meth:`shutdown`, and at exit.
Callbacks depend on the strategy, never the reverse (the sync cadence is handed over by
``WeightSyncCallback.setup`` as :attr:`sync_interval`). Only Lightning's public API is used.

Several training ranks: :class:`AsyncRolloutDDPStrategy` is the same rollout side
(:class:`RolloutStrategyMixin`) on Lightning's ``DDPStrategy`` (``devices=N``, ``num_nodes``; gloo on
CPU, nccl on GPU). Every rank drives its own controller and RolloutLoop over its own rollout workers
and its own share of the prompts (a ``DistributedSampler``), so groups never straddle ranks and the
global batch is ranks x batch_size; rank 0 starts (or joins) Ray and the other ranks join it. A
sync is collective: every rank reaches it at the same RL step (the cadence is a step count), quiesces
its workers, pushes its replica of the weights (identical under DDP) to them, advances the same
version, and a barrier ends it. Checkpoints hold every rank's loop state; a resume needs the same
number of ranks. :class:`AsyncRolloutFSDPStrategy` is the same again on Lightning's
``ModelParallelStrategy`` (FSDP2): the module shards its networks in ``configure_model`` and a sync
gathers the sharded weights whole before each rank pushes them (see ``unirl_lightning.sharding``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import time
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from jsonargparse.typing import NonNegativeInt, PositiveInt
from lightning.pytorch.strategies import (
    DDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    StrategyRegistry,
)

from unirl_lightning.checks import require_at_least, require_choice, require_positive
from unirl_lightning.engines import EngineConfig, EngineName, check_engine_name, resolve_engine
from unirl_lightning.rollout.agentic_loop import AgenticRolloutLoop
from unirl_lightning.rollout.controller import BatchRolloutController
from unirl_lightning.rollout.loop import PendingBatch, RolloutLoop
from unirl_lightning.rollout.types import RolloutRequest
from unirl_lightning.weight_sync import WeightSync, WeightSyncName, resolve_weight_sync

log = logging.getLogger(__name__)

Placement = Literal["separate", "colocate"]
DEFAULT_ENGINES = {"token": "hf", "diffusion": "diffusion"}
"""``engine="auto"``: the engine each policy family is served with by default."""
CHECKPOINT_KEY = "unirl_rollout"


def check_rollout_settings(placement: str, max_staleness: int, max_inflight: int) -> None:
    """The rules between rollout settings, checked once (the strategy and the CLI call this)."""
    require_choice("placement", placement, Placement)
    require_at_least("max_staleness", max_staleness, 0)
    require_at_least("max_inflight", max_inflight, 1)
    if placement == "colocate" and (max_staleness > 0 or max_inflight > 1):
        raise ValueError(
            "placement='colocate' runs generation and training on the same device in turn, so it cannot "
            f"overlap them: it needs max_staleness=0 and max_inflight=1, got max_staleness={max_staleness}, "
            f"max_inflight={max_inflight}; use placement='separate' for async training"
        )


class RolloutStrategyMixin:
    """The rollout side of a Lightning strategy (see the module docstring); mixed in before a Lightning
    strategy class, every hook calls ``super()``.

    Rollout settings (:meth:`init_rollout`, the keyword arguments of every sibling strategy):

    Args:
        engine: what serves the policy in the workers: ``"hf"``, ``"vllm"``, ``"sglang"``,
            ``"diffusion"``, an :class:`~unirl_lightning.engines.EngineConfig`, or ``"auto"`` (the
            module family's default: ``hf`` for LLM modules, ``diffusion`` for Flow-GRPO).
        max_staleness: a sample launched under weight version ``v`` is trained only while
            ``current_version - v <= max_staleness``. 0 = on-policy.
        max_inflight: rollout requests (one training step of prompts each) in flight at once.
        num_workers: rollout workers (Ray actors) per training rank; each prompt batch is split
            across them.
        num_cpus_per_worker / num_gpus_per_worker: Ray resources of each worker.
        placement: ``"separate"`` (generators on their own devices; required for async) or
            ``"colocate"`` (engines sleep while the trainer runs; synchronous only).
        weight_sync: ``"object_store"`` (default), ``"collective"`` or a ``WeightSync`` instance.
        seed: base seed of the rollout requests (request ``g`` of rank ``r`` samples with
            ``seed + r * 1_000_003 + g``).
        trainer_threads: torch threads of each training process on CPU. None = the rule of
            :meth:`_cpu_threads`: synchronous runs give every core to whichever side is working;
            async runs give each local worker ``ceil(num_cpus_per_worker)`` cores and the trainers
            the rest. Engines with ``num_threads="auto"`` (the default) follow the same rule.
        generation_timeout_s: how long a worker may take for one request of up to 1024 samples
            (proportionally longer for larger ones) before it counts as hung and is replaced.
        max_worker_restarts: dead or hung workers replaced over the run (a new actor gets the
            current weights and the lost requests are relaunched with their gen_id and stamp);
            past that the run fails naming the worker, the gen_id and the wait.
    """

    def init_rollout(
        self,
        engine: EngineName | EngineConfig = "auto",
        max_staleness: NonNegativeInt = 1,
        max_inflight: PositiveInt = 2,
        num_workers: PositiveInt = 1,
        num_cpus_per_worker: float = 1,
        num_gpus_per_worker: float = 0,
        placement: Placement = "separate",
        weight_sync: WeightSyncName | WeightSync = "object_store",
        seed: int = 0,
        trainer_threads: PositiveInt | None = None,
        generation_timeout_s: float = 600.0,
        max_worker_restarts: NonNegativeInt = 3,
    ) -> None:
        check_rollout_settings(placement, max_staleness, max_inflight)
        if isinstance(engine, str):
            check_engine_name(engine)
        require_at_least("num_workers", num_workers, 1)
        if trainer_threads is not None:
            require_at_least("trainer_threads", trainer_threads, 1)
        self.engine = engine
        self.max_staleness = int(max_staleness)
        self.max_inflight = int(max_inflight)
        self.num_workers = int(num_workers)
        self.num_cpus_per_worker = num_cpus_per_worker
        self.num_gpus_per_worker = num_gpus_per_worker
        self.placement = placement
        self.weight_sync: WeightSync = resolve_weight_sync(weight_sync)
        self.seed = seed
        self.trainer_threads = trainer_threads
        self.generation_timeout_s = require_positive("generation_timeout_s", generation_timeout_s)
        self.max_worker_restarts = int(max_worker_restarts)
        self.sync_interval: int | None = None  # handed over by WeightSyncCallback.setup
        self.workers: Any = None
        self.controller: Any = None  # BatchRolloutController, or AgenticRolloutController for agentic modules
        self.episodes: Any = None  # the agentic coordinator over the workers (agentic modules only)
        self.loop: RolloutLoop | AgenticRolloutLoop | None = None
        self._loop_state: dict[str, Any] | None = None
        self.last_sync: dict[str, float] = {}

    # -- lifecycle ------------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # first: under DDP the pushed weights are those of the wrapped module
        if self.root_device.type == "cpu":
            torch.set_num_threads(self.trainer_threads or self._cpu_threads(trainer)["trainer"])
        if self.workers is None:
            self._connect_ray(trainer.world_size)
            self._start_rollout(trainer.lightning_module)
        self.barrier("rollout workers started")

    @property
    def synchronous(self) -> bool:
        """Generation and training take turns (nothing overlaps): ``max_inflight=1, max_staleness=0``."""
        return self.max_inflight == 1 and self.max_staleness == 0

    def _cpu_threads(self, trainer: Any) -> dict[str, int]:
        """The CPU rule: cores on this node for the trainer (per local rank) and for each local worker.

        Synchronous runs take turns, so the side that is working gets every core (the idle side's
        threads sleep). Async runs overlap: each local worker keeps ``ceil(num_cpus_per_worker)``
        cores and the trainers share the rest (at least 1 each). With ``RAY_ADDRESS`` the workers
        live elsewhere and the trainers take the node.
        """
        cores = os.cpu_count() or 1
        local_ranks = max(1, trainer.world_size // max(1, trainer.num_nodes))
        local_workers = 0 if os.environ.get("RAY_ADDRESS") else local_ranks * self.num_workers
        if self.synchronous or not local_workers:
            return {"trainer": max(1, cores // local_ranks), "worker": max(1, cores // max(1, local_workers))}
        per_worker = max(1, math.ceil(self.num_cpus_per_worker))
        return {"trainer": max(1, (cores - local_workers * per_worker) // local_ranks), "worker": per_worker}

    def _connect_ray(self, world_size: int) -> None:
        """One Ray for every rank: rank 0 starts (or joins ``RAY_ADDRESS``) it, the others join it."""
        if world_size == 1:
            return  # the worker group starts or joins Ray on demand
        import ray

        from unirl_lightning.workers.group import ensure_ray

        address = None
        if self.global_rank == 0:
            wanted = math.ceil(world_size * self.num_workers * self.num_cpus_per_worker)
            ensure_ray(num_cpus=max(wanted, os.cpu_count() or 1))
            address = ray.get_runtime_context().gcs_address
        address = self.broadcast(address, src=0)
        if self.global_rank != 0 and not ray.is_initialized():
            # an explicit address authenticates only when token auth was on before ray was imported
            # (the CLI and the tests set RAY_AUTH_MODE=token); otherwise "auto" finds this node's cluster
            explicit = os.environ.get("RAY_ADDRESS") or (
                address if os.environ.get("RAY_AUTH_MODE") == "token" else None
            )
            ray.init(address=explicit or "auto", log_to_driver=True)
            if ray.get_runtime_context().gcs_address != address:
                raise RuntimeError(
                    f"rank {self.global_rank} joined the Ray cluster at {ray.get_runtime_context().gcs_address}, but "
                    f"rank 0 runs one at {address}: set RAY_AUTH_MODE=token (or RAY_ADDRESS) before the run starts"
                )

    def _start_rollout(self, module: Any) -> None:
        from unirl_lightning.workers import RolloutWorkerGroup

        spec = module.rollout_spec()
        if spec.max_inflight is not None and self.max_inflight > spec.max_inflight:
            raise ValueError(
                f"max_inflight must be <= {spec.max_inflight} for {type(module).__name__}, got "
                f"{self.max_inflight}: {spec.max_inflight_reason}"
            )
        engine = resolve_engine(self.engine, DEFAULT_ENGINES[spec.family], spec.family)
        engine.validate(spec.policy, spec.lora)
        if getattr(engine, "num_threads", None) == "auto":  # the CPU rule (see _cpu_threads)
            worker_threads = self._cpu_threads(self.lightning_module.trainer)["worker"]
            engine = dataclasses.replace(engine, num_threads=worker_threads)
        self.workers = RolloutWorkerGroup(
            engine,
            spec.policy,
            spec.lora,
            reward=spec.reward,
            num_workers=self.num_workers,
            num_cpus_per_worker=self.num_cpus_per_worker,
            num_gpus_per_worker=self.num_gpus_per_worker,
            generation_timeout_s=self.generation_timeout_s,
            max_restarts=self.max_worker_restarts,
        )
        self.workers.on_restart = self._push_to_replacement
        state = self._loop_state or {}
        if spec.agentic is not None:  # multi-turn episodes: a coordinator inside each worker drives them
            from unirl_lightning.workers.agentic import agentic_controller

            self.episodes, self.controller = agentic_controller(
                self.workers, spec, state, self.generation_timeout_s
            )
        else:
            self.controller = BatchRolloutController(
                self.workers.generate,
                complete=self._complete,
                start_gen_id=state.get("next_gen_id", 0),
                start_weight_version=state.get("weight_version", 0),
            )
        # the workers start from the trainer's weights, at the current version (no bump)
        self.weight_sync.push(module.policy, self.workers, self.controller.weight_version)

    def _push_to_replacement(self, index: int) -> None:
        """A replaced worker starts from the trainer's current weights, labelled with the current
        version: no sync has happened since its lost requests were launched, so their stamp stays
        an upper bound on their staleness (the weights may be fresher in async runs, never older)."""
        subset = self.workers.subset([index])
        self.weight_sync.push(self.lightning_module.policy, subset, self.controller.weight_version)

    def _complete(self, gen_id: int, weight_version: int, result: Any) -> list[Any]:
        return self.loop.complete(gen_id, weight_version, result)

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if not trainer.training:  # validation/test/predict dataloaders pass through untouched
            return dataloader
        if self.sync_interval is None:
            raise RuntimeError(
                "no weight-sync cadence: add a WeightSyncCallback to the trainer (RLModule subclasses add "
                "one by default through configure_callbacks)"
            )
        spec = self.lightning_module.rollout_spec()
        rank_seed = self.seed + self.global_rank * 1_000_003  # ranks sample from different streams

        def build_request(records: list[dict[str, Any]], gen_id: int) -> RolloutRequest:
            return RolloutRequest(
                records=records,
                n=spec.num_generations,
                sampling=spec.sampling,
                seed=rank_seed + gen_id,
                gen_id=gen_id,
            )

        if spec.agentic is not None:  # multi-turn episodes: the agentic loop (refill, poll, drain, finalize)
            self.loop = AgenticRolloutLoop(
                dataloader,
                self.controller,
                self.episodes,
                collate=spec.collate,
                num_generations=spec.num_generations,
                max_staleness=self.max_staleness,
                max_inflight=self.max_inflight,
                seed=rank_seed,
                stall_timeout_s=self.generation_timeout_s,
                extra_stats=lambda: {
                    "rollout/worker_restarts": float(self.workers.restarts),
                    "agentic/relaunched_episodes": float(self.episodes.relaunched),
                },
            )
        else:
            self.loop = RolloutLoop(
                dataloader,
                self.controller,
                collate=spec.collate,
                build_request=build_request,
                max_staleness=self.max_staleness,
                max_inflight=self.max_inflight,
                sync_interval=self.sync_interval,
                order=spec.order,
                extra_stats=lambda: {"rollout/worker_restarts": float(self.workers.restarts)},
            )
        if self._loop_state is not None:
            self.loop.load_loop_state(self._loop_state)
            self._loop_state = None
        return self.loop

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if isinstance(batch, PendingBatch):  # the RL step runs here, after the previous step's sync
            batch = batch.resolve()
            if self.placement == "colocate":  # nothing is in flight (synchronous): free the device to train
                self.workers.call("sleep")
        return super().batch_to_device(batch, device, dataloader_idx)

    # -- the two verbs callbacks use ------------------------------------------------------------
    def sync_weights(self) -> dict[str, float]:
        """Quiesce (wait for everything in flight), push the trainer's weights, bump the version.

        With several ranks every rank calls it at the same RL step (it is collective): each quiesces
        and pushes to its own workers, then a barrier ends the sync."""
        ctl = self.controller
        if ctl is None:
            raise RuntimeError(
                "sync_weights was called before the strategy was set up (call trainer.fit first)"
            )
        start = time.perf_counter()
        ctl.quiesce()
        quiesce_s = time.perf_counter() - start
        if self.loop is not None:
            self.loop.blocked_s += quiesce_s  # generation the trainer waited for was not hidden
        stats: dict[str, Any] = {}

        def push(new_version: int) -> None:
            self.workers.ensure_alive(min(30.0, self.generation_timeout_s))  # nothing is in flight now
            if self.placement == "colocate":  # wake for the push and the next generation
                self.workers.call("wake")
            result = self.weight_sync.push(self.lightning_module.policy, self.workers, new_version)
            stats.update(time_s=result.time_s, bytes=result.bytes)

        version = ctl.sync_weights(push)
        self.barrier("weight sync")  # every rank has pushed and advanced to the same version
        self.last_sync = {
            "sync/time_s": stats["time_s"],
            "sync/bytes": float(stats["bytes"]),
            "sync/quiesce_s": quiesce_s,
            "sync/weight_version": float(version),
        }
        return self.last_sync

    def evaluate(
        self, records: list[dict[str, Any]], sampling: Any, n: int = 1, seed: int = 0
    ) -> list[list[Any]]:
        """Generate and score ``records`` with the weights the workers hold now. Read-only: it neither
        pushes weights nor changes the version, and it does not touch the training buffers."""
        if self.workers is None:
            raise RuntimeError("evaluate was called before the strategy was set up (call trainer.fit first)")
        # agentic modules: whole episodes (every turn, scored by the environment)
        if self.episodes is not None:
            return self.episodes.evaluate(records, sampling, n, seed, self.generation_timeout_s)
        request = RolloutRequest(records=records, n=n, sampling=sampling, seed=seed, gen_id=-1)
        return self.workers.generate(request).result()["groups"]

    @property
    def weight_version(self) -> int:
        return self.controller.weight_version if self.controller is not None else 0

    # -- checkpointing --------------------------------------------------------------------------
    def rollout_state_dict(self) -> dict[str, Any]:
        """This rank's loop position and version ledger (plain Python types)."""
        if self.loop is not None:
            return self.loop.loop_state()
        return dict(self._loop_state or {})

    def gather_rollout_state(self) -> dict[str, Any]:
        """Every rank's rollout state, ``{"world_size": W, "ranks": [state_0, ...]}`` (collective)."""
        state = self.rollout_state_dict()
        if self.world_size == 1:
            return {"world_size": 1, "ranks": [state]}
        states: list[Any] = [None] * self.world_size
        dist.all_gather_object(states, state)
        return {"world_size": self.world_size, "ranks": states}

    def load_rollout_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's share of a checkpoint's rollout state (a single rank's state is accepted as is);
        applied when the rollout side starts (or at once if it runs already)."""
        if "ranks" in state:
            if state["world_size"] != self.world_size:
                raise ValueError(
                    f"the checkpoint was written by {state['world_size']} training rank(s) and this run has "
                    f"{self.world_size}: resume with the same number of ranks (each rank's prompt stream and "
                    "in-flight requests are its own)"
                )
            state = state["ranks"][self.global_rank]
        self._loop_state = dict(state)
        live = isinstance(self.controller, BatchRolloutController)  # (agentic: adopted at the next setup)
        if live and self.controller.inflight == 0 and self.controller.buffered == 0:
            # a live controller adopts the checkpoint's ledger so that stamps stay comparable
            self.controller = BatchRolloutController(
                self.workers.generate,
                complete=self._complete,
                start_gen_id=state["next_gen_id"],
                start_weight_version=state["weight_version"],
            )

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Lightning's save plus the rollout state; a local file is written next to its final name
        and renamed into place, so a crash while saving never leaves a half-written checkpoint."""
        checkpoint[CHECKPOINT_KEY] = self.gather_rollout_state()  # Lightning calls this on every rank
        path = os.fspath(filepath)
        if "://" in path:  # a remote filesystem: Lightning's own transaction
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        partial = f"{path}.partial"
        super().save_checkpoint(checkpoint, partial, storage_options)
        if self.is_global_zero:
            # a sharded checkpoint is a folder (every rank's shard is in it once the collective save returns
            # on rank 0); a folder cannot replace another in one step
            if os.path.isdir(partial) and os.path.exists(path):
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            os.replace(partial, path)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if CHECKPOINT_KEY in checkpoint:
            self.load_rollout_state_dict(checkpoint[CHECKPOINT_KEY])
        return checkpoint

    # -- teardown -------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        log.warning("stopping rollout workers after %s", type(exception).__name__)
        self._failed = True
        self.shutdown()  # no collective here: another rank may be gone
        super().on_exception(exception)

    def teardown(self) -> None:
        """Several ranks: stop this rank's workers, then Ray in order (the joined ranks first, rank 0
        last). One rank keeps its workers for the next ``fit`` on the same strategy."""
        if self.world_size > 1 and not getattr(self, "_failed", False) and self.workers is not None:
            import ray

            self.barrier("rollout teardown")
            self.shutdown()
            if self.global_rank != 0 and ray.is_initialized():
                ray.shutdown()
            self.barrier("rollout teardown: joined ranks left Ray")
        super().teardown()

    def shutdown(self) -> None:
        """Kill the workers (and the local Ray this run started). Safe to call twice."""
        from unirl_lightning.workers.group import shutdown_ray_if_owned

        if self.workers is not None:
            self.workers.shutdown()
        self.weight_sync.close()
        self.workers = None
        self.controller = None
        self.loop = None
        shutdown_ray_if_owned()


class AsyncRolloutStrategy(RolloutStrategyMixin, SingleDeviceStrategy):
    """Train on one device while rollout workers generate asynchronously.

    Args:
        device: the training device, ``"auto"`` = ``cuda:0`` when visible else ``cpu``.
        **rollout: the rollout settings, :meth:`RolloutStrategyMixin.init_rollout` (``engine``,
            ``max_staleness``, ``max_inflight``, ``num_workers``, ``placement``, ``weight_sync``, ...).

    Example::

        trainer = Trainer(strategy=AsyncRolloutStrategy(engine="hf", max_staleness=1, max_inflight=2),
                          max_steps=100)
        trainer.fit(GRPOModule(...), datamodule=PromptDataModule("digit_successor"))
    """

    strategy_name = "async_rollout"

    def __init__(self, device: str = "auto", **rollout: Any) -> None:
        if device == "auto":
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        super().__init__(device=torch.device(device))
        self.init_rollout(**rollout)


class AsyncRolloutDDPStrategy(RolloutStrategyMixin, DDPStrategy):
    """Train on several ranks with Lightning's DDP while rollout workers generate asynchronously.

    ``Trainer(strategy=AsyncRolloutDDPStrategy(...), devices=N, num_nodes=M)``; see the module
    docstring for how rollout, sync and checkpoints work across ranks.

    Args:
        process_group_backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU); None = Lightning's choice.
        timeout_s: timeout of every collective of the training process group.
        find_unused_parameters: DDP's flag (trainable parameters some backward does not reach).
        **rollout: the rollout settings, :meth:`RolloutStrategyMixin.init_rollout` (``num_workers`` is
            per rank).

    Example::

        Trainer(strategy=AsyncRolloutDDPStrategy(max_staleness=1, num_workers=1), accelerator="cpu",
                devices=2, max_steps=100)
    """

    strategy_name = "async_rollout_ddp"

    def __init__(
        self,
        process_group_backend: Literal["gloo", "nccl"] | None = None,
        timeout_s: float = 1800.0,
        find_unused_parameters: bool = False,
        **rollout: Any,
    ) -> None:
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=require_positive("timeout_s", timeout_s)),
            find_unused_parameters=find_unused_parameters,
        )
        self.init_rollout(**rollout)


class AsyncRolloutFSDPStrategy(RolloutStrategyMixin, ModelParallelStrategy):
    """Train on several ranks with sharded parameters (FSDP2, Lightning's ``ModelParallelStrategy``)
    while rollout workers generate asynchronously.

    The module's ``configure_model`` shards its networks (policy, reference, critic) over the device
    mesh Lightning builds: shape ``(num_nodes, devices)``, used as HSDP (parameters sharded across the
    devices of a node, replicated across nodes; one node = plain FSDP). Every rank trains on its own
    prompts (a ``DistributedSampler`` over all ranks, like DDP) and drives its own rollout workers. A
    weight sync gathers each parameter whole, one tensor at a time (a collective every rank enters at
    the same RL step), and each rank pushes the full weights to its own workers; the version
    advances once for everyone and a barrier ends the sync. The peak memory of a push is one gathered
    tensor on the training device plus the full weights in host memory (what the push ships).
    Checkpoints are one file by default (full state on rank 0) and resume like the other strategies.

    Args:
        process_group_backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU); None = Lightning's choice.
        timeout_s: timeout of every collective of the training process group.
        save_distributed_checkpoint: True = every rank writes its shard into a checkpoint folder
            (large models); False = one file with the full state, written by rank 0.
        **rollout: the rollout settings, :meth:`RolloutStrategyMixin.init_rollout` (``num_workers`` is
            per rank).

    Example::

        Trainer(strategy=AsyncRolloutFSDPStrategy(max_staleness=1, num_workers=1), accelerator="cpu",
                devices=2, max_steps=100)
    """

    strategy_name = "async_rollout_fsdp"

    def __init__(
        self,
        process_group_backend: Literal["gloo", "nccl"] | None = None,
        timeout_s: float = 1800.0,
        save_distributed_checkpoint: bool = False,
        **rollout: Any,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=require_positive("timeout_s", timeout_s)),
        )
        self.init_rollout(**rollout)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank is a data-parallel replica with prompts of its own (the mesh's second dimension
        shards parameters, it is not tensor parallelism)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup(self, trainer: Any) -> None:
        module = trainer.lightning_module
        if module.rollout_spec().family != "token":
            raise ValueError(
                f"AsyncRolloutFSDPStrategy shards LLM modules (GRPOModule, PPOModule, AgenticGRPOModule); "
                f"{type(module).__name__} is not one: train it with AsyncRolloutStrategy or AsyncRolloutDDPStrategy"
            )
        super().setup(trainer)


for _cls, _description in (
    (AsyncRolloutStrategy, "Lightning training on one device + asynchronous rollout workers on Ray"),
    (AsyncRolloutDDPStrategy, "Lightning DDP training ranks + asynchronous rollout workers on Ray"),
    (AsyncRolloutFSDPStrategy, "Lightning FSDP2 training ranks + asynchronous rollout workers on Ray"),
):
    if _cls.strategy_name not in StrategyRegistry:
        StrategyRegistry.register(_cls.strategy_name, _cls, description=f"{_description} (unirl_lightning)")
