"""The two bases of every RL module.

:class:`RLModule` is the contract with the strategy: :meth:`~RLModule.rollout_spec` says *what* is
served (policy spec, LoRA spec, reward, sampling, group size, batch type); the strategy decides
*where and how* (engine, workers, placement, weight sync). It also supplies the callbacks the
staleness contract needs (:meth:`~RLModule.configure_callbacks`) when the user did not.

:class:`PolicyGradientModule` owns what every policy-gradient algorithm here shares: the AdamW
optimizer, the ``ppo_epochs`` x ``mini_batches`` update loop with the metrics of its first
mini-batch (taken before any update of the step, so ``train/ratio_mean`` is the on-policy pin),
gradient clipping through Lightning, the frozen reference policy for a KL term, and the per-step
logging. A subclass supplies two things in the order they run: :meth:`prepare_batch` (advantages
and anything else computed once per batch, without gradients) and :meth:`minibatch_loss` (the
loss of one mini-batch and its metrics).

The update reads in CleanRL's order (:meth:`~PolicyGradientModule.update`): prepare the step's
context once, then ``ppo_epochs`` x mini-batches x micro-batches of (loss, backward), then clip, then
step. Micro-batches are a :class:`~unirl_lightning.modules.microbatch.MicroBatcher`'s (plan, view,
scale, combine): the mini-batch's loss, gradients and metrics whatever the cut. A subclass says what
its loss is a mean over (:meth:`~PolicyGradientModule.loss_units`, and per metric
:meth:`~PolicyGradientModule.metric_weight`). Under DDP only the last backward of a mini-batch
reduces the gradients.

Precision: a module whose :attr:`~PolicyGradientModule.compute_dtype` is bf16/fp16 (a causal-LM
policy loaded in bf16) trains mixed precision: at ``setup`` every trainable parameter becomes a
float32 master (so AdamW and its state are float32, and updates below bf16 resolution are kept),
while the frozen ones (KL reference, LoRA base weights) stay in the low dtype; forwards run under
:meth:`~PolicyGradientModule.autocast`, and weight pushes cast back to the serving dtype.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn

from unirl_lightning.callbacks import (
    CheckpointOnExit,
    RLProgressBar,
    RLRichProgressBar,
    TimelineWriter,
    WeightSyncCallback,
    WeightVersionLogger,
)
from unirl_lightning.core.checks import require_at_least
from unirl_lightning.core.preflight import fused_optimizer_allowed, precision_warning
from unirl_lightning.distributed.sharding import full_tensor
from unirl_lightning.modules.context import StepContext
from unirl_lightning.modules.microbatch import MicroBatch, MicroBatcher
from unirl_lightning.modules.optim import LOW_PRECISION_DTYPES, adamw, upcast_trainable_parameters
from unirl_lightning.modules.ranks import distributed_world_size, mean_over_ranks
from unirl_lightning.modules.schedule import LRSchedule, check_schedule, lr_factor
from unirl_lightning.modules.spec import RolloutSpec
from unirl_lightning.weight_sync.base import set_serving_dtype


def _no_closure() -> None:
    """The closure of a manual-optimization step (the backward has run already)."""


class RLModule(LightningModule):
    """Base of the RL modules: manual optimization, the rollout spec, default callbacks."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def rollout_spec(self) -> RolloutSpec:  # pragma: no cover - abstract
        raise NotImplementedError

    def eval_sampling(self, temperature: float) -> Any:  # pragma: no cover - abstract
        """The sampling of a held-out evaluation at ``temperature`` (0 = deterministic)."""
        raise NotImplementedError

    def default_callbacks(self) -> list[Callback]:
        """The callbacks this module runs with unless the trainer has one of the same type."""
        return [WeightSyncCallback(), WeightVersionLogger(), CheckpointOnExit(), TimelineWriter()]

    optimizer_steps_per_batch: int = 1
    """Optimizer steps per RL step (``ppo_epochs x mini_batches``). Lightning's step counter
    (``trainer.max_steps``, ``trainer.global_step``, ``ModelCheckpoint(every_n_train_steps)``, the
    loggers' x-axis) counts RL steps: see :meth:`PolicyGradientModule.take_optimizer_step`."""

    def configure_callbacks(self) -> list[Callback]:
        """Lightning hook (runs before callback ``setup`` and before a checkpoint is restored):
        the default callbacks whose type the trainer lacks, and the RL progress bar in place of
        Lightning's default one (Lightning replaces a trainer callback by a returned subclass); a bar
        the user configured with settings of its own is kept."""
        present = {type(c) for c in self.trainer.callbacks}
        callbacks = [c for c in self.default_callbacks() if type(c) not in present]
        bars = [c for c in self.trainer.callbacks if type(c) in (TQDMProgressBar, RichProgressBar)]
        if bars and _as_built_by_default(bars[0]):  # a bar configured by the user stays
            callbacks.append(RLProgressBar() if type(bars[0]) is TQDMProgressBar else RLRichProgressBar())
        return callbacks


def _as_built_by_default(bar: Callback) -> bool:
    """Whether a progress bar has the settings of the one Lightning adds by default (then the RL bar, which
    counts RL steps, replaces it); a bar with settings of its own is the user's."""
    return bar.refresh_rate == 1 and getattr(bar, "process_position", 0) == 0


class PolicyGradientModule(RLModule):
    """Policy-gradient base: the update loop, the optimizer step, the reference policy, logging.

    Keyword arguments (a subclass passes its own through):
        lr, weight_decay, betas: AdamW over the trainable parameters of ``self.policy`` (with LoRA:
            the adapters).
        lr_schedule, warmup_steps: the learning rate's schedule, stepped every optimizer step
            (:mod:`~unirl_lightning.modules.schedule`; ``warmup_steps`` in RL steps; ``"linear"`` and
            ``"cosine"`` decay to 0 at ``trainer.max_steps``, in RL steps).
        ppo_epochs, mini_batches: passes over each rollout batch, and optimizer steps per pass.
        max_grad_norm: gradient clipping by norm through Lightning (``clip_gradients``); 0 = off.
        kl_coef: weight of a KL term to the reference policy (the initial weights; with LoRA the
            adapter-free model); 0 = no reference is kept.
        micro_batcher: how each mini-batch is cut into micro-batches whose gradients accumulate into
            its one optimizer step (:class:`~unirl_lightning.modules.microbatch.MicroBatcher`); the
            default cuts nothing. The loss, the gradients and the logged metrics are the mini-batch's.

    A subclass sets ``self.policy`` (the trained ``nn.Module``) and ``self.lora`` in its
    ``__init__`` and implements :meth:`prepare_batch` and :meth:`minibatch_loss`; one that needs
    several backward passes per micro-batch overrides :meth:`backward_micro_batch`.
    """

    def __init__(
        self,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        ppo_epochs: int,
        mini_batches: int,
        max_grad_norm: float,
        kl_coef: float,
        micro_batcher: MicroBatcher | None = None,
        lr_schedule: LRSchedule = "constant",
        warmup_steps: int = 0,
    ) -> None:
        super().__init__()
        require_at_least("lr", lr, 0)
        check_schedule(lr_schedule, warmup_steps)
        self.lr_schedule, self.warmup_steps = lr_schedule, warmup_steps
        require_at_least("ppo_epochs", ppo_epochs, 1)
        require_at_least("mini_batches", mini_batches, 1)
        require_at_least("max_grad_norm", max_grad_norm, 0)
        require_at_least("kl_coef", kl_coef, 0)
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.ppo_epochs, self.mini_batches = ppo_epochs, mini_batches
        self.max_grad_norm = max_grad_norm
        self.kl_coef = kl_coef
        self.micro_batcher = micro_batcher or MicroBatcher()
        self.optimizer_steps_per_batch = ppo_epochs * mini_batches
        self.lora: Any = None
        self.ref_policy: torch.nn.Module | None = None
        self.first_minibatch = True
        self._last_step_end: float | None = None
        self.last_advantages: torch.Tensor | None = None
        self.last_step_metrics: dict[str, torch.Tensor] = {}
        self.last_logged_metrics: dict[str, float] = {}
        self.step_lr: float | None = None  # the learning rate of the step's first optimizer step

    # -- what a subclass supplies ---------------------------------------------------------------
    def prepare_batch(self, batch: Any) -> StepContext:  # pragma: no cover - abstract
        """Everything computed once per batch, before any update (advantages, old log-probs, ...),
        with one row per batch row (a mini-batch takes its rows with ``context.select``)."""
        raise NotImplementedError

    def minibatch_loss(
        self, minibatch: Any, context: StepContext
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # pragma: no cover - abstract
        """The loss of one (micro-)batch, a mean over its :meth:`loss_units`, with gradient, and its
        detached metrics."""
        raise NotImplementedError

    def loss_units(self, batch: Any, context: StepContext) -> torch.Tensor:
        """What the loss of ``batch`` is a mean over (here its rows), as a float scalar tensor."""
        return torch.tensor(float(batch.num_rows), device=batch.rewards.device)

    def metric_weight(self, batch: Any, context: StepContext, key: str) -> torch.Tensor:
        """What metric ``key`` of ``batch`` is a mean over, to combine micro-batches (here its
        :meth:`loss_units`)."""
        return self.loss_units(batch, context)

    global_loss_mean: bool = False
    """Whether the loss is a mean over the union of the ranks' :meth:`loss_units` (the global token
    mean) rather than over each rank's own."""

    # -- the update, in CleanRL's order ---------------------------------------------------------
    def update(self, batch: Any, context: StepContext) -> dict[str, torch.Tensor]:
        """``ppo_epochs`` passes of ``mini_batches`` optimizer steps, each the backward of its
        micro-batches, then clipping, then the step; returns the first mini-batch's metrics (taken
        before any update of this step), with the gradient norm before clipping."""
        optimizer = self.optimizers()
        self.step_lr = optimizer.param_groups[0]["lr"]
        rows = torch.arange(batch.num_rows, device=batch.rewards.device)
        minibatches = [mb for _epoch in range(self.ppo_epochs) for mb in rows.chunk(self.mini_batches)]
        first: dict[str, torch.Tensor] = {}
        for i, mb in enumerate(minibatches):
            optimizer.zero_grad()
            self.first_minibatch = not first  # only its metrics are logged: costly ones only then
            metrics = self.backward_minibatch(batch.select(mb), context.select(mb))
            if not first:
                grads = [p.grad for p in self.parameters() if p.grad is not None]
                first = {**metrics, "grad_norm": full_tensor(torch.nn.utils.get_total_norm(grads))}
            if self.max_grad_norm > 0:
                self.clip_gradients(
                    optimizer, gradient_clip_val=self.max_grad_norm, gradient_clip_algorithm="norm"
                )
            self.take_optimizer_step(optimizer, counted=i == len(minibatches) - 1)
        return first

    def take_optimizer_step(self, optimizer: Any, counted: bool) -> None:
        """One optimizer step, then the schedulers'. Lightning's step counter counts RL steps, the
        user's one clock: only an RL step's last optimizer step goes through the
        ``LightningOptimizer`` (which counts it); the others go straight to the trainer's strategy
        (``Strategy.optimizer_step``: the same precision plugin and hooks, without the count)."""
        trainer = self.attached_trainer()
        if counted or trainer is None or not isinstance(optimizer, LightningOptimizer):
            optimizer.step()
        else:
            trainer.strategy.optimizer_step(optimizer.optimizer, closure=_no_closure)
        self.step_schedulers()

    def step_schedulers(self) -> None:
        """Step every learning-rate scheduler once (manual optimization: Lightning does not)."""
        trainer = self.attached_trainer()
        for config in trainer.lr_scheduler_configs if trainer is not None else []:
            config.scheduler.step()

    def micro_batches(self, minibatch: Any, context: StepContext) -> list[MicroBatch]:
        """The micro-batches of ``minibatch`` with their loss factors (:meth:`MicroBatcher.split`)."""
        return self.micro_batcher.split(
            minibatch,
            context,
            self.loss_units,
            world=self.data_parallel_size(),
            device=self.device,
            global_mean=self.global_loss_mean,
        )

    def backward_minibatch(self, minibatch: Any, context: StepContext) -> dict[str, torch.Tensor]:
        """The backward of every micro-batch of one mini-batch; returns the mini-batch's metrics,
        ``loss`` included (:meth:`MicroBatcher.combine`)."""
        results = [
            (micro, self.backward_micro_batch(micro)) for micro in self.micro_batches(minibatch, context)
        ]
        return self.micro_batcher.combine(results, self.metric_weight)

    def backward_micro_batch(self, micro: MicroBatch) -> dict[str, torch.Tensor]:
        """One micro-batch's loss, scaled by its share of the mini-batch's normaliser, backpropagated
        (the gradients reduced across ranks on the mini-batch's last); its metrics and loss."""
        loss, metrics = self.minibatch_loss(micro.batch, micro.context)
        with self.gradient_sync(micro.last):
            self.manual_backward(loss * micro.scale.to(loss.dtype))
        return {**metrics, "loss": loss.detach()}

    def per_micro_batch(self, batch: Any, compute: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """A no-grad per-token ``compute`` over the micro-batches of ``batch`` (:meth:`MicroBatcher.map`)."""
        return self.micro_batcher.map(batch, compute, world=self.data_parallel_size(), device=self.device)

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """A no-op context when ``enabled`` (or without a trainer); otherwise the strategy's
        ``block_backward_sync`` (DDP's ``no_sync``: the gradients of the backward run under it
        accumulate locally and are reduced, with the rest, by the mini-batch's last backward).
        FSDP2 reduce-scatters every backward (its gradients stay sharded)."""
        trainer = self.attached_trainer()
        strategy = trainer.strategy if trainer is not None else None
        if enabled or not isinstance(strategy, ParallelStrategy):
            return contextlib.nullcontext()
        return strategy.block_backward_sync()

    def data_parallel_size(self) -> int:
        """The number of data-parallel ranks: the trainer's world size, or without a trainer the
        default process group's (1 without ``torch.distributed``)."""
        trainer = self.attached_trainer()
        return trainer.world_size if trainer is not None else distributed_world_size()

    def attached_trainer(self) -> Any:
        """The ``Trainer`` this module is attached to, or None (a module used on its own, as the tests
        do; Lightning's ``trainer`` property raises then)."""
        try:
            return self.trainer
        except RuntimeError:
            return None

    # -- precision ------------------------------------------------------------------------------
    compute_dtype: torch.dtype | None = None
    """The low-precision dtype forwards run in over float32 master weights (bf16/fp16), or None:
    compute in the parameters' own dtype. A subclass derives it from its policy spec."""

    def autocast(self, device_type: str | None = None) -> contextlib.AbstractContextManager:
        """``torch.autocast`` to :attr:`compute_dtype` on ``device_type`` (default: the module's
        device); a no-op context when :attr:`compute_dtype` is None. Wrap forwards only (not
        ``backward``, not the loss math)."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type or self.device.type, dtype=self.compute_dtype)

    # -- shared machinery -----------------------------------------------------------------------
    def build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over the policy's trainable parameters, fused where the trainer's precision allows it
        (:func:`~unirl_lightning.core.preflight.fused_optimizer_allowed`; a warning names the fix when the
        module computes in a low dtype of its own, :func:`~unirl_lightning.core.preflight.precision_warning`)."""
        params = [p for p in self.policy.parameters() if p.requires_grad]
        trainer = self.attached_trainer()
        precision = trainer.precision if trainer is not None else None
        dtype = str(self.compute_dtype).removeprefix("torch.") if self.compute_dtype is not None else None
        warning = precision_warning(precision, dtype)
        if warning is not None:
            rank_zero_warn(warning)
        return adamw(
            params,
            allow_fused=fused_optimizer_allowed(precision),
            lr=self.lr,
            weight_decay=self.weight_decay,
            betas=self.betas,
        )

    def configure_optimizers(self) -> Any:
        """:meth:`build_optimizer`, with the ``lr_schedule`` as a per-step ``LambdaLR`` unless it is
        constant without warmup (then the optimizer alone: checkpoints hold no scheduler)."""
        optimizer = self.build_optimizer()
        if self.lr_schedule == "constant" and self.warmup_steps == 0:
            return optimizer
        trainer = self.attached_trainer()
        total = trainer.max_steps if trainer is not None and trainer.max_steps > 0 else None
        if self.lr_schedule != "constant" and total is None:
            raise ValueError(
                f"lr_schedule={self.lr_schedule!r} decays to 0 at trainer.max_steps: set trainer.max_steps "
                "(RL steps), or use lr_schedule='constant'"
            )
        # the schedule is stepped every optimizer step; its settings are in RL steps
        per_step = self.optimizer_steps_per_batch
        schedule, warmup = self.lr_schedule, self.warmup_steps * per_step
        total = total * per_step if total is not None else None
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            functools.partial(lr_factor, lr_schedule=schedule, warmup_steps=warmup, total_steps=total),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def setup(self, stage: str) -> None:
        # the KL reference: a frozen copy of the initial policy (with LoRA: the same model, adapters
        # off), taken before the masters are upcast, so it stays in the policy's own (low) dtype
        if self.kl_coef > 0 and self.lora is None and self.ref_policy is None:
            self.ref_policy = copy.deepcopy(self.policy).requires_grad_(False).eval()
        # Lightning calls setup before configure_model (FSDP2 sharding) and before configure_optimizers
        if self.compute_dtype in LOW_PRECISION_DTYPES:
            upcast_trainable_parameters(self)
            if self.lora is None:  # full weights are pushed in the dtype the engines serve (LoRA
                set_serving_dtype(self.policy, self.compute_dtype)  # adapters: as held, float32)

    @contextlib.contextmanager
    def reference_policy(self) -> Iterator[torch.nn.Module]:
        """The reference model, for use under ``torch.no_grad()``."""
        if self.lora is not None:
            with self.policy.disable_adapter():
                yield self.policy
        else:
            yield self.ref_policy

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        start = time.perf_counter()
        context = self.prepare_batch(batch)
        first = self.update(batch, context)
        self.last_step_metrics = first  # this rank's own figures (the logged ones are means over ranks)
        self.last_advantages = context.advantages  # what the step trained on (CompletionLogger)
        end = time.perf_counter()
        # the strategy's timeline, when it has one (duck-typed: a module never imports the strategy)
        trainer = self.attached_trainer()
        timeline = getattr(getattr(trainer and trainer.strategy, "runtime", None), "timeline", None)
        if timeline is not None:
            timeline.span(
                "train_step", time.time() - (end - start), time.time(), cat="train", rows=batch.num_rows
            )
        n = batch.num_rows
        metrics: dict[str, Any] = {
            **batch.stats,
            **{f"train/{k}": v for k, v in first.items()},
            "train/lr": self.step_lr,
            "perf/train_time_s": end - start,
        }
        if self._last_step_end is not None:  # end to end: generation waits, training and sync included
            wall_s = end - self._last_step_end
            metrics["perf/samples_per_s"] = n / wall_s
            if "rollout/completion_tokens" in batch.stats:
                metrics["perf/tokens_per_s"] = batch.stats["rollout/completion_tokens"] / wall_s
        self._last_step_end = end
        self.log_step_metrics(metrics, batch_size=n)
        return first["loss"]

    # the figures most runs watch go through self.log (progress bar, callback_metrics, monitors)
    WATCHED = ("rollout/reward_mean", "train/loss", "train/ratio_mean", "train/logp_diff_abs", "train/kl")

    def log_step_metrics(self, metrics: dict[str, Any], batch_size: int) -> None:
        """Log one RL step's figures straight to the trainer's loggers every ``log_every_n_steps`` RL
        steps, at the step's number (``global_step`` after its update: 1 for the first, the x-axis of
        the evaluations, completions and histograms too); the :attr:`WATCHED` ones also through
        ``self.log`` without its logger (the progress bar shows the reward; ``callback_metrics``
        feeds monitors). ``self.log`` costs about a millisecond of bookkeeping per key. With several
        ranks every figure is the mean over the ranks that have it (:func:`mean_over_ranks`: the keys
        are the union over the ranks). ``last_logged_metrics`` keeps them all."""
        # on the module's device: the reduction runs on the training backend (NCCL reduces CUDA tensors only)
        reduced = mean_over_ranks(metrics, self.device)
        self.last_logged_metrics = reduced
        for key in self.WATCHED:
            if key in reduced:
                prog_bar = key == "rollout/reward_mean"
                self.log(key, reduced[key], prog_bar=prog_bar, logger=False, batch_size=batch_size)
        if self.global_step % max(1, self.trainer.log_every_n_steps) == 0:
            for logger in self.loggers:
                logger.log_metrics(reduced, step=self.global_step)
