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

Micro-batches: every mini-batch may be split into micro-batches of rows (``micro_batch_rows``; a
causal-LM module also packs rows by a token budget) whose gradients accumulate inside the one
optimizer step. A micro-batch's loss is scaled by its share of the mini-batch's normaliser
(:meth:`~PolicyGradientModule.loss_units` over :meth:`~PolicyGradientModule.loss_normalizer`), so
the mini-batch's loss is exactly the sum of its micro-batches' contributions, and its metrics are
combined as the mini-batch's would be (sums for the aggregated losses, weighted means for the
rest, see :meth:`~PolicyGradientModule.combine_micro_metrics`). Under DDP only the last backward of
a mini-batch reduces the gradients.

Precision: a module whose :attr:`~PolicyGradientModule.compute_dtype` is bf16/fp16 (a causal-LM
policy loaded in bf16) trains mixed precision: at ``setup`` every trainable parameter becomes a
float32 master (so AdamW and its state are float32, and updates below bf16 resolution are kept),
while the frozen ones (KL reference, LoRA base weights) stay in the low dtype; forwards run under
:meth:`~PolicyGradientModule.autocast`, and weight pushes cast back to the serving dtype.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import ParallelStrategy

from unirl_lightning.callbacks import (
    CheckpointOnExit,
    RLProgressBar,
    RLRichProgressBar,
    TimelineWriter,
    WeightSyncCallback,
    WeightVersionLogger,
)
from unirl_lightning.checks import require_at_least
from unirl_lightning.modules.microbatch import (
    distributed_world_size,
    max_over_ranks,
    mean_over_ranks,
    split_to_count,
)
from unirl_lightning.modules.optim import LOW_PRECISION_DTYPES, adamw, upcast_trainable_parameters
from unirl_lightning.rollout.agentic_loop import AgenticSpec
from unirl_lightning.rollout.records import PolicyFamily
from unirl_lightning.sharding import full_tensor
from unirl_lightning.weight_sync.base import set_serving_dtype


@dataclass
class RolloutSpec:
    """The rollout side of a module, read by the strategy.

    Attributes:
        policy: the policy spec every engine builds (``build()`` in the worker).
        lora: the LoRA spec the trainer trains with (engines wrap the policy the same way), or None.
        reward: scores each sample in the worker.
        num_generations: samples per prompt (the group size).
        sampling: the engine's sampling parameters (``SamplingParams`` / ``DiffusionSampling``).
        collate: ``collate(groups) -> batch`` of the module's batch type.
        family: ``"token"`` (causal LMs) or ``"diffusion"``; ``engine="auto"`` serves it with the
            family's default engine, and the family's runtime schedules its requests
            (:data:`unirl_lightning.runtime.batch.SCHEDULING`).
        agentic: multi-turn episodes (:class:`~unirl_lightning.rollout.agentic_loop.AgenticSpec`:
            environment, tail policy, environment errors); the strategy then drives an
            :class:`~unirl_lightning.rollout.agentic_loop.AgenticRolloutLoop`. None = single-turn.
        filter_groups: drop groups whose rewards are all equal before training and launch more
            prompts until the step's batch is full (DAPO's dynamic sampling; batch runtime only).
        max_filter_launches_per_step: the most extra requests one step may launch to replace
            dropped groups; a step that needs more raises.
    """

    policy: Any
    lora: Any
    reward: Any
    num_generations: int
    sampling: Any
    collate: Callable[[list[list[Any]]], Any]
    family: PolicyFamily = "token"
    agentic: AgenticSpec | None = None
    filter_groups: bool = False
    max_filter_launches_per_step: int = 10


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
    """Optimizer steps per RL step (``trainer.max_steps`` counts optimizer steps)."""

    def configure_callbacks(self) -> list[Callback]:
        """Lightning hook (runs before callback ``setup`` and before a checkpoint is restored):
        the default callbacks whose type the trainer lacks, and the RL progress bar in place of
        Lightning's default one (Lightning replaces a trainer callback by a returned subclass)."""
        present = {type(c) for c in self.trainer.callbacks}
        callbacks = [c for c in self.default_callbacks() if type(c) not in present]
        if TQDMProgressBar in present:
            callbacks.append(RLProgressBar())
        elif RichProgressBar in present:
            callbacks.append(RLRichProgressBar())
        return callbacks


def select_rows(context: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """Every tensor of ``context`` restricted to ``rows`` (other values as they are)."""
    return {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in context.items()}


class PolicyGradientModule(RLModule):
    """Policy-gradient base: the update loop, the optimizer step, the reference policy, logging.

    Args:
        lr / weight_decay / betas: AdamW over the trainable parameters of ``self.policy`` (with
            LoRA: the adapters).
        ppo_epochs / mini_batches: passes over each rollout batch, and optimizer steps per pass.
        max_grad_norm: gradient clipping by norm through Lightning (``clip_gradients``); 0 = off.
        kl_coef: weight of a KL term to the reference policy (the initial weights; with LoRA the
            adapter-free model); 0 = no reference is kept.
        micro_batch_rows: split every mini-batch into micro-batches of at most this many rows (every
            forward and backward, the no-grad recomputes included), accumulating their gradients into
            the mini-batch's one optimizer step; None = one micro-batch (the whole mini-batch). The
            loss, the gradients and the logged metrics are those of the whole mini-batch.

    A subclass sets ``self.policy`` (the trained ``nn.Module``) and ``self.lora`` in its
    ``__init__`` and implements :meth:`prepare_batch` and :meth:`minibatch_loss`; one that needs
    several backward passes per mini-batch overrides :meth:`backward_minibatch`.
    """

    def __init__(
        self,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        ppo_epochs: int,
        mini_batches: int,
        max_grad_norm: float,
        kl_coef: float,
        micro_batch_rows: int | None = None,
    ) -> None:
        super().__init__()
        require_at_least("lr", lr, 0)
        if micro_batch_rows is not None:
            require_at_least("micro_batch_rows", micro_batch_rows, 1)
        require_at_least("ppo_epochs", ppo_epochs, 1)
        require_at_least("mini_batches", mini_batches, 1)
        require_at_least("max_grad_norm", max_grad_norm, 0)
        require_at_least("kl_coef", kl_coef, 0)
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.ppo_epochs, self.mini_batches = ppo_epochs, mini_batches
        self.max_grad_norm = max_grad_norm
        self.kl_coef = kl_coef
        self.micro_batch_rows = micro_batch_rows
        self.optimizer_steps_per_batch = ppo_epochs * mini_batches
        self.lora: Any = None
        self.ref_policy: torch.nn.Module | None = None
        self.first_minibatch = True
        self._last_step_end: float | None = None
        self.last_advantages: torch.Tensor | None = None
        self.last_step_metrics: dict[str, torch.Tensor] = {}
        self.last_logged_metrics: dict[str, float] = {}
        self._rl_steps = 0

    # -- what a subclass supplies ---------------------------------------------------------------
    def prepare_batch(self, batch: Any) -> dict[str, Any]:  # pragma: no cover - abstract
        """Everything computed once per batch, before any update (advantages, old log-probs, ...),
        as tensors with one row per batch row (sliced per mini-batch by :func:`select_rows`)."""
        raise NotImplementedError

    def minibatch_loss(
        self, minibatch: Any, context: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # pragma: no cover - abstract
        """The loss of one mini-batch (with gradient) and its detached metrics."""
        raise NotImplementedError

    def backward_minibatch(self, minibatch: Any, context: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Backward pass(es) of one mini-batch, one per micro-batch (:meth:`micro_batches`), each
        micro-batch's loss scaled by its share of the mini-batch's normaliser; returns the mini-batch's
        metrics, ``loss`` included (:meth:`combine_micro_metrics`)."""
        parts = self.micro_batches(minibatch)
        normalizer = self.loss_normalizer(minibatch, context)
        results = []
        for i, rows in enumerate(parts):
            micro, micro_context = self.micro_view(minibatch, context, rows, len(parts))
            scale = self.micro_scale(micro, micro_context, normalizer)
            loss, metrics = self.minibatch_loss(micro, micro_context)
            with self.gradient_sync(i == len(parts) - 1):
                self.manual_backward(loss * scale.to(loss.dtype))
            results.append(({**metrics, "loss": loss.detach()}, scale, micro, micro_context))
        return self.combine_micro_metrics(results)

    # -- micro-batches --------------------------------------------------------------------------
    SUMMED_METRICS = frozenset({"loss", "pg_loss", "vf_loss"})
    """Metrics that are aggregated losses: a mini-batch's is the sum of its micro-batches' scaled ones."""
    MAX_METRICS = frozenset({"ratio_dev_max"})
    """Metrics that are maxima over the rows: a mini-batch's is the largest of its micro-batches'."""

    def pack_micro_batches(self, batch: Any) -> list[list[int]]:
        """The rows of ``batch`` (indices) of each micro-batch: consecutive runs of
        ``micro_batch_rows``, or all rows in one. A subclass may pack otherwise (by tokens)."""
        n = batch.num_rows
        size = self.micro_batch_rows or max(n, 1)
        return [list(range(start, min(start + size, n))) for start in range(0, n, size)] or [[]]

    def micro_batches(self, batch: Any) -> list[torch.Tensor]:
        """Row-index tensors of the micro-batches of ``batch`` (:meth:`pack_micro_batches`). With
        several ranks every rank gets as many micro-batches (the most any rank packed; one all-reduce,
        made only when micro-batches are on): a sharded model all-gathers in every forward, so the
        ranks must run the same number of them."""
        parts = self.pack_micro_batches(batch)
        if self.micro_batching and self.data_parallel_size() > 1:
            parts = split_to_count(parts, max_over_ranks(len(parts), self.device))
        device = batch.rewards.device
        return [torch.tensor(p, dtype=torch.long, device=device) for p in parts]

    @property
    def micro_batching(self) -> bool:
        """Whether mini-batches are split into micro-batches at all."""
        return self.micro_batch_rows is not None

    def micro_view(
        self, batch: Any, context: dict[str, Any], rows: torch.Tensor, num_parts: int
    ) -> tuple[Any, dict[str, Any]]:
        """Micro-batch ``rows`` of ``batch`` with its context (the whole of them when it is the only one)."""
        if num_parts == 1 and len(rows) == batch.num_rows:
            return batch, context
        return batch.select(rows), select_rows(context, rows)

    def loss_units(self, batch: Any, context: dict[str, Any]) -> torch.Tensor:
        """What the loss of ``batch`` is a mean over (here its rows), as a float scalar tensor."""
        return torch.tensor(float(batch.num_rows), device=batch.rewards.device)

    def loss_normalizer(self, minibatch: Any, context: dict[str, Any]) -> torch.Tensor:
        """The normaliser of a mini-batch's loss, shared by its micro-batches (here its
        :meth:`loss_units`, at least 1)."""
        return self.loss_units(minibatch, context).clamp(min=1)

    def micro_scale(self, micro: Any, context: dict[str, Any], normalizer: torch.Tensor) -> torch.Tensor:
        """The factor of a micro-batch's loss: its :meth:`loss_units` over the mini-batch's normaliser
        (exactly 1 for the whole mini-batch on one rank)."""
        return (self.loss_units(micro, context) / normalizer).to(torch.float32)

    def metric_weight(self, batch: Any, context: dict[str, Any], key: str) -> torch.Tensor:
        """What metric ``key`` of ``batch`` is a mean over, to combine micro-batches (here its rows)."""
        return self.loss_units(batch, context)

    def combine_micro_metrics(
        self, results: list[tuple[dict[str, torch.Tensor], torch.Tensor, Any, dict[str, Any]]]
    ) -> dict[str, torch.Tensor]:
        """The mini-batch's metrics from its micro-batches' ``(metrics, scale, batch, context)``: the
        :attr:`SUMMED_METRICS` as the sum of the scaled micro-batch values (the loss that was
        backpropagated), the :attr:`MAX_METRICS` as the largest, every other one as the mean of the
        micro-batch values weighted by :meth:`metric_weight` (a token mean stays a token mean)."""
        if len(results) == 1:
            metrics, scale, _, _ = results[0]
            return {k: v * scale if k in self.SUMMED_METRICS else v for k, v in metrics.items()}
        combined = {}
        for key in results[0][0]:
            values = torch.stack([m[key].float() for m, _, _, _ in results])
            if key in self.SUMMED_METRICS:
                combined[key] = (values * torch.stack([s for _, s, _, _ in results])).sum()
            elif key in self.MAX_METRICS:
                combined[key] = values.max()
            else:
                weights = torch.stack([self.metric_weight(b, c, key).float() for _, _, b, c in results])
                combined[key] = (values * weights).sum() / weights.sum().clamp(min=1)
        return combined

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
    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        # Lightning's AMP plugin (``Trainer(precision="16-mixed" | "bf16-mixed")``) refuses to clip
        # the gradients of an optimizer that unscales them itself, as the fused kernel does
        trainer = self.attached_trainer()
        amp = trainer is not None and isinstance(trainer.precision_plugin, MixedPrecision)
        return adamw(
            params, allow_fused=not amp, lr=self.lr, weight_decay=self.weight_decay, betas=self.betas
        )

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

    def update(self, batch: Any, context: dict[str, Any]) -> dict[str, torch.Tensor]:
        """``ppo_epochs`` passes of ``mini_batches`` optimizer steps; returns the first mini-batch's
        metrics (taken before any update of this step), with the gradient norm before clipping."""
        optimizer = self.optimizers()
        rows = torch.arange(batch.num_rows, device=batch.rewards.device)
        first: dict[str, torch.Tensor] = {}
        for _epoch in range(self.ppo_epochs):
            for mb in rows.chunk(self.mini_batches):
                optimizer.zero_grad()
                self.first_minibatch = not first  # only its metrics are logged: costly ones only then
                metrics = self.backward_minibatch(batch.select(mb), select_rows(context, mb))
                if not first:
                    grads = [p.grad for p in self.parameters() if p.grad is not None]
                    first = {**metrics, "grad_norm": full_tensor(torch.nn.utils.get_total_norm(grads))}
                if self.max_grad_norm > 0:
                    self.clip_gradients(
                        optimizer, gradient_clip_val=self.max_grad_norm, gradient_clip_algorithm="norm"
                    )
                optimizer.step()
        return first

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        start = time.perf_counter()
        context = self.prepare_batch(batch)
        first = self.update(batch, context)
        self.last_step_metrics = first  # this rank's own figures (the logged ones are means over ranks)
        self.last_advantages = context.get("advantages")  # what the step trained on (CompletionLogger)
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
            "train/lr": self.optimizers().param_groups[0]["lr"],
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
        """Log one RL step's figures: the :attr:`WATCHED` ones through ``self.log`` (reward on the
        progress bar), the rest straight to the trainer's loggers every ``log_every_n_steps`` RL steps
        (``self.log`` costs about a millisecond of bookkeeping per key). With several ranks every
        figure is the mean over the ranks that have it (:func:`mean_over_ranks`: the keys are the
        union over the ranks). ``last_logged_metrics`` keeps them all."""
        # on the module's device: the reduction runs on the training backend (NCCL reduces CUDA tensors only)
        reduced = mean_over_ranks(metrics, self.device)
        self.last_logged_metrics = reduced
        for key in self.WATCHED:
            if key in reduced:
                self.log(key, reduced[key], prog_bar=key == "rollout/reward_mean", batch_size=batch_size)
        self._rl_steps += 1
        if self._rl_steps % max(1, self.trainer.log_every_n_steps) == 0:
            rest = {k: v for k, v in reduced.items() if k not in self.WATCHED}
            for logger in self.loggers:
                logger.log_metrics(rest, step=self.global_step)
