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

from unirl_lightning.callbacks import (
    CheckpointOnExit,
    RLProgressBar,
    RLRichProgressBar,
    WeightSyncCallback,
    WeightVersionLogger,
)
from unirl_lightning.checks import require_at_least
from unirl_lightning.rollout.agentic_loop import AgenticSpec
from unirl_lightning.rollout.loop import RolloutOrder
from unirl_lightning.rollout.types import PolicyFamily
from unirl_lightning.sharding import full_tensor


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
            family's default engine.
        order: ``"launch_first"`` or ``"poll_first"`` (see :mod:`unirl_lightning.rollout.loop`).
        max_inflight: the most requests this module allows in flight (None = no limit), and
            ``max_inflight_reason`` why; the strategy refuses a larger ``max_inflight``.
        agentic: multi-turn episodes (:class:`~unirl_lightning.rollout.agentic_loop.AgenticSpec`:
            environment, tail policy, environment errors); the strategy then drives an
            :class:`~unirl_lightning.rollout.agentic_loop.AgenticRolloutLoop`. None = single-turn.
    """

    policy: Any
    lora: Any
    reward: Any
    num_generations: int
    sampling: Any
    collate: Callable[[list[list[Any]]], Any]
    family: PolicyFamily = "token"
    order: RolloutOrder = "launch_first"
    max_inflight: int | None = None
    max_inflight_reason: str = ""
    agentic: AgenticSpec | None = None


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
        return [WeightSyncCallback(), WeightVersionLogger(), CheckpointOnExit()]

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
    ) -> None:
        super().__init__()
        require_at_least("lr", lr, 0)
        require_at_least("ppo_epochs", ppo_epochs, 1)
        require_at_least("mini_batches", mini_batches, 1)
        require_at_least("max_grad_norm", max_grad_norm, 0)
        require_at_least("kl_coef", kl_coef, 0)
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.ppo_epochs, self.mini_batches = ppo_epochs, mini_batches
        self.max_grad_norm = max_grad_norm
        self.kl_coef = kl_coef
        self.optimizer_steps_per_batch = ppo_epochs * mini_batches
        self.lora: Any = None
        self.ref_policy: torch.nn.Module | None = None
        self.first_minibatch = True
        self._last_step_end: float | None = None
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
        """Backward pass(es) of one mini-batch; returns its metrics, ``loss`` included."""
        loss, metrics = self.minibatch_loss(minibatch, context)
        self.manual_backward(loss)
        return {**metrics, "loss": loss.detach()}

    # -- shared machinery -----------------------------------------------------------------------
    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay, betas=self.betas)

    def setup(self, stage: str) -> None:
        # the KL reference: a frozen copy of the initial policy (with LoRA: the same model, adapters off)
        if self.kl_coef > 0 and self.lora is None and self.ref_policy is None:
            self.ref_policy = copy.deepcopy(self.policy).requires_grad_(False).eval()

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
        end = time.perf_counter()
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
        figure is the mean over the ranks (one all-reduce). ``last_logged_metrics`` keeps them all."""
        names = sorted(metrics)
        values = torch.tensor([float(metrics[k]) for k in names], dtype=torch.float64)
        if self.trainer.world_size > 1:
            values = self.trainer.strategy.reduce(values, reduce_op="mean")
        reduced = dict(zip(names, values.tolist()))
        self.last_logged_metrics = reduced
        for key in self.WATCHED:
            if key in reduced:
                self.log(key, reduced[key], prog_bar=key == "rollout/reward_mean", batch_size=batch_size)
        self._rl_steps += 1
        if self._rl_steps % max(1, self.trainer.log_every_n_steps) == 0:
            rest = {k: v for k, v in reduced.items() if k not in self.WATCHED}
            for logger in self.loggers:
                logger.log_metrics(rest, step=self.global_step)
