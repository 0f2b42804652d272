"""FlowGRPOModule: Flow-GRPO (Liu et al. 2025) for flow-matching image models, in Lightning.

The rollout workers sample images with the Flow-GRPO SDE and record, for every SDE step, the
latents before and after it and its Gaussian transition log-prob (:mod:`unirl_lightning.engines.diffusion`).
``training_step`` receives a :class:`DiffusionBatch` of ``n`` scored images per prompt and runs, in
this order: group-normalised advantages (clipped to ``adv_clip_max``) -> ``ppo_epochs`` x
mini-batches of [for each trained SDE step: replay the step with the trainer's weights
(``guided_velocity`` + ``sde_step(prev_sample=...)``) -> per-step clipped ratio loss (+ KL to the
reference) -> backward] -> clip -> optimizer step. All math is in :mod:`unirl_lightning.algorithms`.

On-policy pin: with ``max_staleness=0`` the workers generate with exactly the trainer's weights, so
the replayed log-prob of every step equals the recorded one and ``train/ratio_dev_max``
(``max |ratio - 1|`` over the first mini-batch) stays below 1e-4 in fp32.

Async: diffusion rollouts are large (trajectory latents), so the batch runtime schedules the
diffusion family with one request in flight (``max_inflight > 1`` is refused with the reason) and a
loop that polls before it launches (``order="poll_first"``); overlap comes from ``max_staleness >= 1``: the next
request generates while this step trains. Sample images before and after training are the
:class:`~unirl_lightning.callbacks.SampleImageLogger`'s (a default callback of this module).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from unirl_lightning.algorithms import group_advantages, ppo_clip_loss, sde_step
from unirl_lightning.algorithms.flow import flow_grpo_kl, sde_std_dev_t
from unirl_lightning.callbacks import SampleImageLogger
from unirl_lightning.core.checks import require_at_least, require_in_range
from unirl_lightning.models.diffusion import SD3FlowModel, TinyFlowModel, guided_velocity
from unirl_lightning.models.lora import LoraSpec, apply_lora
from unirl_lightning.modules.base import PolicyGradientModule
from unirl_lightning.modules.context import FlowContext
from unirl_lightning.modules.microbatch import MicroBatch, MicroBatcher
from unirl_lightning.modules.schedule import LRSchedule
from unirl_lightning.modules.spec import RolloutSpec
from unirl_lightning.rollout.batches import DiffusionBatch
from unirl_lightning.rollout.records import DiffusionSampling

__all__ = ["FlowGRPOModule"]


class FlowGRPOModule(PolicyGradientModule):
    """Flow-GRPO: GRPO on the SDE steps of a flow-matching image model, with optional LoRA and KL.

    Args:
        policy: the model spec (:class:`TinyFlowModel` on CPU, :class:`SD3FlowModel` on GPU); every
            rollout engine builds the same spec.
        reward: an image reward (``unirl_lightning.rewards.image``) or any reward object; default
            :class:`~unirl_lightning.rewards.image.TargetColorReward` (red).
        lora: LoRA adapters on the denoiser (only they train, only they are synced); None = full
            fine-tuning with full-weight sync.
        num_generations: images per prompt (the group size), ``>= 2``.
        num_steps / eta / sde_indices / guidance_scale: sampling (see
            :class:`~unirl_lightning.rollout.records.DiffusionSampling`); ``eta > 0`` to train.
        lr: AdamW's learning rate.
        weight_decay: AdamW's decoupled weight decay.
        betas: AdamW's ``(beta1, beta2)``.
        lr_schedule: ``"constant"``, ``"linear"`` or ``"cosine"`` decay to 0 at ``trainer.max_steps``,
            per optimizer step, as :class:`~unirl_lightning.modules.causal_lm.CausalLMModule`'s.
        warmup_steps: RL steps of linear warmup from 0 to ``lr`` (stepped every optimizer step); 0 = none.
        clip_range: PPO clip range of the per-step ratio (Flow-GRPO uses 1e-4: a step's log-prob
            is a mean over latent elements, so ratios stay very close to 1).
        adv_clip_max: advantages are clipped to ``[-adv_clip_max, adv_clip_max]``.
        kl_coef: KL to the reference (the initial weights; with LoRA the adapter-free model), as
            flow_grpo computes it: ``mean((mean - mean_ref)^2) / (2 std_dev_t^2)`` per step, the exact
            Gaussian KL times the step size (so flow_grpo's published betas carry over).
        timestep_fraction: fraction of the recorded SDE steps trained on per RL step (a random
            subset, as in Flow-GRPO); 1.0 = all.
        ppo_epochs: passes over each batch.
        mini_batches: optimizer steps per pass.
        max_grad_norm: gradient clipping through Lightning; 0 = off.
        micro_batch_rows: replay each SDE step for at most this many images at a time, accumulating
            the gradients into the mini-batch's one optimizer step (a row is an image: a row budget is
            the memory knob here, not a token one); None = the whole mini-batch. The loss, the
            gradients and the logged metrics are the whole mini-batch's.

    Example::

        module = FlowGRPOModule(policy=TinyFlowModel(), reward=TargetColorReward((1, 0, 0)),
                                num_generations=8, num_steps=8, eta=1.0, lr=1e-3)
        Trainer(strategy=AsyncRolloutStrategy(max_staleness=1, max_inflight=1), max_steps=60).fit(
            module, datamodule=ImagePromptDataModule(batch_size=4))
    """

    def __init__(
        self,
        policy: TinyFlowModel | SD3FlowModel | None = None,
        reward: Any = None,
        lora: LoraSpec | None = None,
        num_generations: int = 8,
        num_steps: int = 10,
        eta: float = 1.0,
        sde_indices: list[int] | None = None,
        guidance_scale: float = 1.0,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        lr_schedule: LRSchedule = "constant",
        warmup_steps: int = 0,
        clip_range: float = 1e-4,
        adv_clip_max: float = 5.0,
        kl_coef: float = 0.0,
        timestep_fraction: float = 1.0,
        ppo_epochs: int = 1,
        mini_batches: int = 1,
        max_grad_norm: float = 1.0,
        micro_batch_rows: int | None = None,
    ) -> None:
        super().__init__(
            lr=lr,
            weight_decay=weight_decay,
            betas=betas,
            ppo_epochs=ppo_epochs,
            mini_batches=mini_batches,
            max_grad_norm=max_grad_norm,
            kl_coef=kl_coef,
            lr_schedule=lr_schedule,
            warmup_steps=warmup_steps,
            micro_batcher=MicroBatcher(max_rows=micro_batch_rows),
        )
        require_at_least("num_generations", num_generations, 2)
        self.sampling = DiffusionSampling(
            num_steps=num_steps,
            eta=eta,
            sde_indices=None if sde_indices is None else tuple(sde_indices),
            guidance_scale=guidance_scale,
        )
        if eta == 0 or not self.sampling.sde_steps():
            raise ValueError(
                f"training needs at least one SDE step: eta must be > 0 and sde_indices non-empty, got eta={eta}, "
                f"sde_indices={sde_indices} (eta=0 is the deterministic ODE, used for eval only)"
            )
        require_in_range("timestep_fraction", timestep_fraction, 0, 1, low_open=True)
        require_in_range("clip_range", clip_range, 0, 1, high_open=True)
        self.save_hyperparameters(ignore=["policy", "reward", "lora"])
        self.policy_spec = policy or TinyFlowModel()
        self.pipeline = self.policy_spec.build()
        if guidance_scale != 1.0 and not self.pipeline.conditional:
            raise ValueError(
                f"guidance_scale must be 1.0 for an unconditional model, got {guidance_scale} (this policy "
                "is unconditional)"
            )
        self.lora = lora.resolved() if lora is not None else None  # its init seed travels to the engines
        if self.lora is not None:
            self.pipeline.denoiser = apply_lora(self.pipeline.denoiser, self.lora, self.pipeline.lora_targets)
        self.policy = self.pipeline.denoiser
        if reward is None:
            from unirl_lightning.rewards.image import TargetColorReward

            reward = TargetColorReward()
        self.reward = reward
        self.num_generations = num_generations
        self.clip_range, self.adv_clip_max = clip_range, adv_clip_max
        self.timestep_fraction = timestep_fraction

    # -- what the strategy needs ----------------------------------------------------------------
    def rollout_spec(self) -> RolloutSpec:
        return RolloutSpec(
            policy=self.policy_spec,
            lora=self.lora,
            reward=self.reward,
            num_generations=self.num_generations,
            sampling=self.sampling,
            collate=DiffusionBatch.collate,
            family="diffusion",
        )

    def eval_sampling(self, temperature: float) -> DiffusionSampling:
        """Eval sampling: ``eta = temperature * eta`` (``temperature=0``: the deterministic ODE)."""
        require_at_least("temperature", temperature, 0)
        return replace(
            self.sampling,
            eta=temperature * self.sampling.eta,
            sde_indices=self.sampling.sde_indices if temperature > 0 else None,
        )

    def default_callbacks(self) -> list[Callback]:
        return [*super().default_callbacks(), SampleImageLogger()]

    # -- Lightning hooks ------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        self.pipeline.to(self.device)  # the frozen parts (text encoders, VAE) that Lightning does not move
        if self.ref_policy is not None:
            self.ref_policy.to(self.device)

    # -- the update -----------------------------------------------------------------------------
    def _train_steps(self, num_steps: int) -> list[int]:
        """The recorded steps trained on this RL step: all, or a random ``timestep_fraction`` of them."""
        if self.timestep_fraction >= 1:
            return list(range(num_steps))
        count = max(1, round(num_steps * self.timestep_fraction))
        generator = torch.Generator().manual_seed(self.global_step)
        return sorted(torch.randperm(num_steps, generator=generator)[:count].tolist())

    def prepare_batch(self, batch: DiffusionBatch) -> FlowContext:
        """Clipped group advantages, the conditioning of every row, and the SDE steps trained on."""
        # flow_grpo normalises by the population std (np.std)
        advantages = group_advantages(batch.rewards, batch.group_size, normalize="std", std="population")
        null = None
        if batch.guidance_scale != 1.0:
            null = self.pipeline.encode_null(batch.num_rows, self.device)
        return FlowContext(
            advantages=advantages.clamp(-self.adv_clip_max, self.adv_clip_max),
            train_steps=self._train_steps(batch.log_probs.shape[1]),
            cond=self.pipeline.encode(batch.records, self.device),
            null=null,
        )

    def _velocity(self, denoiser, batch: DiffusionBatch, step: int, context: FlowContext) -> torch.Tensor:
        latents, sigma = batch.latents[:, step], batch.sigmas[:, step]
        return guided_velocity(
            self.pipeline, denoiser, latents, sigma, context.cond, context.null or None, batch.guidance_scale
        )

    def replay_step(
        self, batch: DiffusionBatch, step: int, context: FlowContext
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Recompute recorded step ``step`` of every row with the trainer's weights; return (loss, metrics)."""
        latents, next_latents = batch.latents[:, step], batch.next_latents[:, step]
        sigma, sigma_next = batch.sigmas[:, step], batch.sigmas_next[:, step]
        velocity = self._velocity(self.policy, batch, step, context)
        _, logp, mean, std = sde_step(
            velocity, latents, sigma, sigma_next, batch.eta, prev_sample=next_latents
        )
        old_logp = batch.log_probs[:, step]
        every_row = torch.ones_like(logp[:, None])
        loss, metrics = ppo_clip_loss(
            logp[:, None],
            old_logp[:, None],
            context.advantages,
            every_row,
            self.clip_range,
            self.clip_range,
        )
        with torch.no_grad():
            log_ratio = logp - old_logp
            metrics["ratio_dev_max"] = (torch.exp(log_ratio) - 1).abs().max()
            metrics["logp_diff_abs"] = log_ratio.abs().mean()
        if self.kl_coef > 0:
            with torch.no_grad(), self.reference_policy() as reference:
                ref_velocity = self._velocity(reference, batch, step, context)
                _, _, ref_mean, _ = sde_step(
                    ref_velocity, latents, sigma, sigma_next, batch.eta, prev_sample=next_latents
                )
            # flow_grpo's KL penalty (the exact Gaussian KL times the step size; its betas carry over)
            kl = flow_grpo_kl(mean, ref_mean, sde_std_dev_t(latents, sigma, sigma_next, batch.eta)).mean()
            loss = loss + self.kl_coef * kl
            metrics["kl"] = kl.detach()
        return loss, metrics

    def backward_micro_batch(self, micro: MicroBatch) -> dict[str, torch.Tensor]:
        """One backward per trained SDE step (memory stays that of one denoiser call on a
        micro-batch), each scaled by the micro-batch's share of the mini-batch's rows over the step
        count; the metrics are averaged over the steps, ``ratio_dev_max`` is their maximum."""
        steps = micro.context.train_steps
        per_step = []
        for j, step in enumerate(steps):
            loss, metrics = self.replay_step(micro.batch, step, micro.context)
            with self.gradient_sync(micro.last and j == len(steps) - 1):
                self.manual_backward(loss * micro.scale.to(loss.dtype) / len(steps))
            per_step.append({**metrics, "loss": loss.detach()})
        merged = {k: torch.stack([m[k] for m in per_step]).mean() for k in per_step[0]}
        merged["ratio_dev_max"] = torch.stack([m["ratio_dev_max"] for m in per_step]).max()
        return merged
