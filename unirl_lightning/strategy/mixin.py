"""The rollout half every strategy of this package shares (:class:`RolloutStrategyMixin`): the rollout
settings, setup before any worker starts, the sync verb, evaluation, the rollout state in checkpoints,
and teardown on error or exit (a cross-rank abort included). The three Lightning strategies built on it
are in :mod:`unirl_lightning.strategy.strategies`."""

from __future__ import annotations

import _thread
import logging
import os
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.utilities import rank_zero_warn

from unirl_lightning.core.checks import require_positive
from unirl_lightning.core.device_rules import collective_device_error, nccl_cumem_setting, sleep_level_error
from unirl_lightning.core.preflight import (
    LaunchUnit,
    SyncMode,
    WorkerLayout,
    hybrid_engine_error,
    inflight_window_warning,
    multi_node_ray_error,
    sync_replacement_error,
    weight_sync_placement_error,
)
from unirl_lightning.core.types import NonNegativeInt, PositiveInt
from unirl_lightning.distributed.abort import CrossRankAbort
from unirl_lightning.engines import EngineConfig, EngineName, engine_name
from unirl_lightning.rollout.loop import DeferredBatch
from unirl_lightning.runtime import (
    Placement,
    RewardWorkers,
    RolloutRuntime,
    RolloutSettings,
    rank_share,
    runtime_for,
)
from unirl_lightning.strategy.checkpoint_io import AtomicCheckpointIO
from unirl_lightning.weight_sync import WeightSync, WeightSyncName, resolve_weight_sync, weight_sync_kind

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "unirl_rollout"


class RolloutStrategyMixin:
    """The rollout side of a Lightning strategy (see the module docstring), mixed in before a Lightning
    strategy class; every hook calls ``super()``; the family's runtime is :attr:`runtime`. The rollout
    settings are :meth:`init_rollout`'s arguments, the keyword arguments of every sibling strategy:

    Args:
        engine: what serves the policy in the workers: ``"hf"``, ``"vllm"``, ``"sglang"``,
            ``"diffusion"``, an :class:`~unirl_lightning.engines.EngineConfig`, or ``"auto"`` (the
            module family's default: ``hf`` for LLM modules, ``diffusion`` for Flow-GRPO).
        max_staleness: a sample launched under weight version ``v`` is trained only while
            ``current_version - v <= max_staleness``. 0 = on-policy.
        max_inflight: rollout requests (one training step of prompts each) in flight at once; with
            ``launch_unit="group"`` the same number of steps' prompts, counted in groups
            (``max_inflight x groups_per_step`` groups in flight across the workers, each sent to the
            least-loaded worker). Size it to what the engines can batch: with continuous batching, a
            worker holds about ``max_inflight x groups_per_step x num_generations / num_workers`` rows,
            which should not exceed its ``max_batch_size``, in as many calls (one per group), which
            its ``concurrent_calls`` should cover (a call past it waits for a free one); ``max_staleness`` bounds it too (with a sync
            every step, group ``g`` may not launch before ``g < (trained_steps + max_staleness + 1) x
            groups_per_step``: ``rollout.controller.admit_groups``).
        num_workers: rollout workers (Ray actors) per training rank, sharing each prompt batch.
        num_cpus_per_worker / num_gpus_per_worker: Ray resources of each worker (a local Ray gets only
            the GPUs the training ranks leave; vLLM's ``tensor_parallel_size`` follows the GPUs).
        worker_resources: more Ray resources per worker: ``{"rollout_node": 1}``, ``{"node:<ip>": 0.01}``.
        worker_layout: a GPU worker's placement group: ``"actor"`` (one bundle) or ``"per_gpu"`` (one a GPU).
        placement: ``"separate"`` (Ray workers on their own devices; required for async),
            ``"colocate"`` (Ray workers on the trainer's device, asleep while it trains; synchronous
            only) or ``"hybrid"`` (one engine inside each training process, on its device, no Ray;
            synchronous only, ``num_workers=1``).
        offload_optimizer: ``"colocate"`` only: the optimizer state goes to the host while engines wake.
        sync_mode: what a weight sync does with the requests in flight: ``"quiesce"`` (wait for them
            to finish) or ``"interrupt"`` (LLM modules, ``placement="separate"``: requests run in
            chunks of ``interrupt_chunk_tokens``; a sync ends each at its current chunk, pushes, and
            resumes it as prompt + partial completion with the new weights; every token keeps the
            version that generated it and a sample is trained only while its oldest token is within
            ``max_staleness``) or ``"continue"`` (``placement="separate"``, an engine that loads
            between decode steps: ``batching="continuous"`` on HF or vLLM): nothing is drained; the
            push lands between two decode steps and the rows in flight go on under the new weights,
            each token keeping its version; a group is trained while its launch stamp, which no
            token is older than, is within ``max_staleness``). Agentic modules always abort at a
            turn boundary.
        interrupt_chunk_tokens: ``sync_mode="interrupt"``: the most new tokens of a sample per
            generation call (the longest a sync waits, in decode steps).
        launch_unit: ``"request"``: one launch is one training step's prompts, reaped whole.
            ``"group"``: one launch is one prompt's ``num_generations`` samples, sent to the least-loaded
            worker and reaped as soon as it finishes, so a step trains the first groups to finish and a
            continuously batching engine (``batching="continuous"``, HF or vLLM) is kept fed; the
            staleness budget is counted in groups (``rollout.controller.admit_groups``).
        weight_sync: ``"auto"`` (the placement's: ``"inprocess"`` for hybrid, else ``"object_store"``),
            ``"object_store"``, ``"collective"`` (Ray workers), ``"inprocess"`` (hybrid only: the
            engine reads the trainer's tensors, or a cast copy) or a ``WeightSync`` instance.
        seed: base seed of the rollout (None = ``seed_everything``'s seed, else 0): every seed is a hash
            of it (request ``g`` of rank ``r``: ``derive_seed(seed, r, g)``): no two requests share one.
        trainer_threads: torch threads of each training process on CPU. None = the CPU rule
            (:func:`~unirl_lightning.runtime.cpu_threads`; engines with ``num_threads="auto"`` follow it).
        generation_timeout_s: seconds a worker may take per request of up to 1024 samples (longer
            ones in proportion) before it counts as hung and is replaced.
        max_worker_restarts: dead or hung workers replaced over the run (the new actor gets the current
            weights, lost requests are relaunched); past that the run fails naming the worker and why.
        abort_timeout_s: several training ranks: an exception on one rank (at setup, in a reward, a push
            or a training step) ends every other rank within this many seconds, with that rank's error
            (:mod:`unirl_lightning.distributed.abort`), instead of leaving them in a collective until the process
            group's ``timeout_s``; a rank that stops answering this long (killed) counts as failed.
        reward_workers: run the module's reward on Ray actors of its own instead of in the rollout
            workers (a learned reward model on its own GPUs): ``{num_workers, num_cpus_per_worker,
            num_gpus_per_worker, resources_per_worker, timeout_s}`` per training rank
            (:class:`~unirl_lightning.runtime.RewardWorkers`), placed like the rollout workers, never on a
            training GPU, in ``placement.json``; a rollout worker hands each result to them and
            generates its next request meanwhile. None = the rollout workers score.
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
        weight_sync: WeightSyncName | WeightSync = "auto",
        seed: int | None = None,
        trainer_threads: PositiveInt | None = None,
        generation_timeout_s: float = 600.0,
        max_worker_restarts: NonNegativeInt = 3,
        worker_resources: dict[str, float] | None = None,
        worker_layout: WorkerLayout = "actor",
        offload_optimizer: bool = False,
        abort_timeout_s: float = 60.0,
        reward_workers: RewardWorkers | None = None,
        sync_mode: SyncMode = "quiesce",
        interrupt_chunk_tokens: PositiveInt = 32,
        launch_unit: LaunchUnit = "request",
    ) -> None:
        self.abort_timeout_s = float(require_positive("abort_timeout_s", abort_timeout_s))
        self.cross_rank_abort: CrossRankAbort | None = None
        self.rollout = RolloutSettings(
            engine=engine,
            max_staleness=int(max_staleness),
            max_inflight=int(max_inflight),
            num_workers=int(num_workers),
            num_cpus_per_worker=num_cpus_per_worker,
            num_gpus_per_worker=num_gpus_per_worker,
            placement=placement,
            seed=seed,
            trainer_threads=trainer_threads,
            generation_timeout_s=generation_timeout_s,
            max_worker_restarts=int(max_worker_restarts),
            worker_resources=worker_resources,
            worker_layout=worker_layout,
            offload_optimizer=offload_optimizer,
            reward_workers=reward_workers,
            sync_mode=sync_mode,
            interrupt_chunk_tokens=int(interrupt_chunk_tokens),
            launch_unit=launch_unit,
        )
        kind = weight_sync if isinstance(weight_sync, str) else weight_sync_kind(weight_sync)
        error = weight_sync_placement_error(placement, kind)
        if error is not None:
            raise ValueError(error)
        self.weight_sync: WeightSync = resolve_weight_sync(weight_sync, placement)
        cumem = nccl_cumem_setting(
            engine_name(self.rollout.engine),
            weight_sync_kind(self.weight_sync),
            str(getattr(self.weight_sync, "backend", "auto")),
            os.environ.get("NCCL_CUMEM_ENABLE"),
        )
        if cumem is not None:  # before Lightning starts the ranks and any NCCL communicator
            os.environ["NCCL_CUMEM_ENABLE"] = cumem
            log.info("NCCL_CUMEM_ENABLE=%s: the SGLang workers' NCCL runs with it (a collective push)", cumem)
        self.sync_interval: int | None = None  # handed over by WeightSyncCallback.setup
        self.runtime: RolloutRuntime | None = None
        self._pending_state: dict[str, Any] | None = None  # a checkpoint's, loaded before setup
        self.last_sync: dict[str, float] = {}
        self.pushed_step = 0  # the RL step whose update the workers hold (0: the weights fit started with)
        self.failed = False  # set by on_exception: teardown then enters no collective
        self.checkpoint_io = AtomicCheckpointIO()  # how single-file checkpoints are written

    # -- lifecycle ------------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # first: under DDP the pushed weights are those of the wrapped module
        threads = self.rollout.cpu_threads(trainer.world_size, trainer.num_nodes)
        if self.root_device.type == "cpu":
            torch.set_num_threads(self.rollout.trainer_threads or threads["trainer"])
        if trainer.world_size > 1 and self.cross_rank_abort is None:
            self.cross_rank_abort = CrossRankAbort.connect(
                self.global_rank,
                trainer.world_size,
                self.broadcast,
                host=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                on_abort=self._end_for_peer,
                poll_s=min(1.0, self.abort_timeout_s / 20),
                timeout_s=self.abort_timeout_s,
            ).start()
        if self.process_group_timeout_s is not None and weight_sync_kind(self.weight_sync) == "collective":
            self.weight_sync.follow_process_group(self.process_group_timeout_s)  # one deadline for both sides
        if self.runtime is None:
            self.preflight(trainer.world_size)  # before Ray and any worker start
            self._connect(trainer.world_size)
            spec = trainer.lightning_module.rollout_spec()
            settings = replace(
                self.rollout,
                rank=self.global_rank,
                worker_threads=threads["worker"],
                sync_interval=self.sync_interval or 1,  # WeightSyncCallback.setup ran before this hook
            )
            self.runtime = runtime_for(spec)(spec, settings, self.weight_sync, self._pending_state)
            self._pending_state = None
            runtime = self.runtime  # placement.json and the table before the first push; overlaps fail
            runtime.start(
                trainer.lightning_module.policy, before_push=lambda: runtime.report_placement(trainer)
            )
        self.barrier("rollout workers started")

    process_group_timeout_s: float | None = None
    """The training process group's collective timeout (several ranks), which a collective weight
    sync without a ``timeout_s`` of its own also waits."""

    shards_model = False
    """Whether the training ranks shard the model (FSDP): a replaced worker cannot be fed by gathering it."""

    def preflight(self, world_size: int) -> None:
        """The setup rules of :mod:`unirl_lightning.core.preflight` that read the strategy alone, checked on every
        rank at the same point (so every rank refuses together), before any worker starts."""
        kind = weight_sync_kind(self.weight_sync)
        error = sync_replacement_error(kind, self.shards_model, world_size, self.rollout.max_worker_restarts)
        if error is None:
            error = multi_node_ray_error(
                int(getattr(self, "num_nodes", 1) or 1), os.environ.get("RAY_ADDRESS")
            )
        if error is None:
            error = hybrid_engine_error(self.rollout.placement, engine_name(self.rollout.engine), world_size)
        if error is None and kind == "collective":
            backend, gpus = self.weight_sync.backend, self.rollout.actor_gpus
            error = collective_device_error(self.rollout.placement, kind, backend, self._device_type(), gpus)
            self.weight_sync.for_workers(gpus)  # "auto" picks NCCL only when the actors hold GPUs
        if error is None:  # a vLLM engine's; LoRA is refused when the engine is built
            sleep_level = getattr(self.rollout.engine, "sleep_level", 1)
            error = sleep_level_error(sleep_level, False, self.sync_interval or 1)
        if error is not None:
            raise ValueError(error)

    def _device_type(self) -> str:
        """``"cuda"`` or ``"cpu"``: the training ranks' device kind, from the Trainer's accelerator (a
        strategy not yet attached to one: whether CUDA is visible)."""
        accelerator = self.accelerator
        if accelerator is None:
            return "cuda" if torch.cuda.is_available() else "cpu"
        return "cpu" if isinstance(accelerator, CPUAccelerator) else "cuda"

    @property
    def worker_group_class(self) -> type:
        """The worker group class of this strategy's placement (imported on first use: a hybrid run
        never imports Ray)."""
        from unirl_lightning.workers.factory import worker_group_class

        return worker_group_class(self.rollout.placement)

    def _connect(self, world_size: int) -> None:
        """What the workers of every rank share, through the placement's group class (a collective:
        Ray's group has rank 0 start or join Ray and the others join it; the hybrid group, nothing)."""
        held = getattr(self, "parallel_devices", None) or [self.root_device]
        self.worker_group_class.connect(self.global_rank, world_size, self.rollout, held, self.broadcast)

    # -- read by callbacks ------------------------------------------------------------------------
    @property
    def rl_steps(self) -> int:
        """RL steps trained so far in this fit (the runtime loop's count)."""
        return self.runtime.loop.steps if self.runtime is not None and self.runtime.loop is not None else 0

    @property
    def weight_version(self) -> int:
        return self.runtime.weight_version if self.runtime is not None else 0

    # -- Lightning's data hooks -----------------------------------------------------------------
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if not trainer.training:  # validation/test/predict dataloaders pass through untouched
            return dataloader
        if self.sync_interval is None:
            raise RuntimeError(
                "no weight-sync cadence: add a WeightSyncCallback to the trainer (RLModule subclasses add "
                "one by default through configure_callbacks)"
            )
        rollout = self.rollout
        warning = inflight_window_warning(
            rollout.launch_unit, rollout.max_staleness, rollout.max_inflight, self.sync_interval
        )
        if warning is not None:
            rank_zero_warn(warning)
        return self.runtime.make_loop(dataloader, self.sync_interval)

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if isinstance(batch, DeferredBatch):  # the RL step runs here, after the previous step's sync
            batch = self.runtime.resolve(batch, self.optimizers)
        return super().batch_to_device(batch, device, dataloader_idx)

    # -- the verbs callbacks use (when to push: WeightSyncCallback) ------------------------------
    def sync_weights(self) -> dict[str, float]:
        """Quiesce (wait for everything in flight), push the trainer's weights, bump the version. With
        several ranks every rank calls it at the same RL step (collective); a barrier ends it."""
        if self.runtime is None or self.runtime.controller is None:
            raise RuntimeError(
                "sync_weights was called before the strategy was set up (call trainer.fit first)"
            )
        quiesced = (lambda: self.barrier("quiesced: pushing")) if self.world_size > 1 else None
        stats = self.runtime.sync_weights(
            self.lightning_module.policy, self.optimizers, after_quiesce=quiesced
        )
        self.barrier("weight sync")  # every rank has pushed and advanced to the same version
        self.last_sync = stats
        self.pushed_step = self.rl_steps
        return self.last_sync

    def evaluate(
        self, records: list[dict[str, Any]], sampling: Any, n: int = 1, seed: int = 0
    ) -> list[list[Any]]:
        """Generate and score ``records`` with the weights the workers hold now. Read-only: it neither
        pushes weights nor changes the version, and it does not touch the training buffers."""
        if self.runtime is None or self.runtime.workers is None:
            raise RuntimeError("evaluate was called before the strategy was set up (call trainer.fit first)")
        return self.runtime.evaluate(records, sampling, n, seed)

    # -- checkpointing --------------------------------------------------------------------------
    def rollout_state_dict(self) -> dict[str, Any]:
        """This rank's loop position and version ledger (plain Python types)."""
        if self.runtime is not None:
            return self.runtime.state_dict()
        return dict(self._pending_state or {})

    def gather_rollout_state(self) -> dict[str, Any]:
        """Every rank's rollout state, ``{"world_size": W, "ranks": [state_0, ...]}`` (collective)."""
        state = self.rollout_state_dict()
        if self.world_size == 1:
            return {"world_size": 1, "ranks": [state]}
        states: list[Any] = [None] * self.world_size
        dist.all_gather_object(states, state)
        return {"world_size": self.world_size, "ranks": states}

    def load_rollout_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's share of a checkpoint's rollout state, applied when the rollout side starts (or by
        the running runtime)."""
        state = rank_share(state, self.world_size, self.global_rank)
        if self.runtime is None:
            self._pending_state = dict(state)
        else:
            self.runtime.load_state_dict(state)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Lightning's save plus every rank's rollout state (Lightning calls this on every rank); the
        file itself is written by the strategy's ``CheckpointIO`` (atomic by default)."""
        checkpoint[CHECKPOINT_KEY] = self.gather_rollout_state()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if CHECKPOINT_KEY in checkpoint:
            self.load_rollout_state_dict(checkpoint[CHECKPOINT_KEY])
        return checkpoint

    # -- teardown -------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        if self.cross_rank_abort is not None:  # first: the other ranks stop waiting for this one
            self.cross_rank_abort.signal(f"rank {self.global_rank}: {type(exception).__name__}: {exception}")
        log.warning("stopping rollout workers after %s", type(exception).__name__)
        self.failed = True
        self.shutdown()  # no collective here: another rank may be gone
        super().on_exception(exception)

    def teardown(self) -> None:
        """Several ranks: stop this rank's workers, then Ray in order (the joined ranks first, rank 0
        last). One rank keeps its workers for the next ``fit`` on the same strategy."""
        if self.cross_rank_abort is not None:  # a clean end: rank 0's store closing is no failure
            self.cross_rank_abort.stop()
            self.cross_rank_abort = None
        if self.world_size > 1 and not self.failed and self.runtime is not None:
            self.barrier("rollout teardown")
            self.shutdown()
            self.worker_group_class.leave(self.global_rank)
            self.barrier("rollout teardown: joined ranks left Ray")
        super().teardown()

    def _end_for_peer(self, message: str) -> None:
        """Another rank failed (:mod:`unirl_lightning.distributed.abort`): interrupt this rank's main thread, give it
        a moment to unwind (it cannot while blocked in a collective), then stop this rank's workers and
        exit with status 1. Runs on the abort thread."""
        grace = min(10.0, self.abort_timeout_s / 4)
        print(
            f"rank {self.global_rank}: ending the run, another rank failed: {message}",
            file=sys.stderr,
            flush=True,
        )
        self.failed = True
        time.sleep(min(2.0, grace))  # the failing rank prints its own traceback first
        _thread.interrupt_main()
        time.sleep(grace)
        cleanup = threading.Thread(target=self.shutdown, name="unirl-abort-cleanup", daemon=True)
        cleanup.start()
        cleanup.join(grace)
        os._exit(1)

    def shutdown(self) -> None:
        """Kill the workers (and the local Ray this run started). Safe to call twice."""
        if self.runtime is not None:
            self.runtime.shutdown()
        self.runtime = None
        self.weight_sync.close()
        self.worker_group_class.release()
