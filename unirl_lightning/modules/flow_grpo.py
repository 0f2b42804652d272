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

Async: diffusion rollouts are large (trajectory latents), so the strategy must keep one request in
flight (``AsyncRolloutStrategy(max_inflight=1)``; more is refused in :meth:`FlowGRPOModule.setup`)
and the loop polls before it launches (``RolloutSpec(order="poll_first")``); overlap comes from
``max_staleness >= 1``: the next request generates while this step trains.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from unirl_lightning.algorithms import group_advantages, ppo_clip_loss, sde_step
from unirl_lightning.data import load_records
from unirl_lightning.data.datamodule import train_loader
from unirl_lightning.engines.diffusion import (
    DiffusionEngineConfig,
    DiffusionRollout,
    DiffusionSampling,
    guided_velocity,
)
from unirl_lightning.lora import LoraSpec
from unirl_lightning.models_diffusion import SD3FlowModel, TinyFlowModel, apply_lora
from unirl_lightning.modules.base import RLModule, RolloutSpec
from unirl_lightning.rollout.types import common_group_size

__all__ = ["DiffusionBatch", "FlowGRPOModule", "ImagePromptDataModule"]


@dataclass
class DiffusionBatch:
    """The recorded SDE steps of ``num_groups * group_size`` images, rows ordered group by group.

    ``latents[i, s]`` / ``next_latents[i, s]`` are the input and sampled output of recorded step ``s``
    of row ``i``, ``log_probs[i, s]`` its behaviour log-prob, ``sigmas[i, s]`` / ``sigmas_next[i, s]``
    its noise levels. ``records`` are the prompt records (the trainer re-encodes the conditioning).
    """

    latents: torch.Tensor  # [N, S, C, h, w] float32
    next_latents: torch.Tensor  # [N, S, C, h, w] float32
    log_probs: torch.Tensor  # [N, S] float32
    sigmas: torch.Tensor  # [N, S]
    sigmas_next: torch.Tensor  # [N, S]
    images: torch.Tensor  # [N, H, W, 3] uint8
    rewards: torch.Tensor  # [N]
    weight_versions: torch.Tensor  # [N] long, launch-time stamp of each row
    gen_ids: torch.Tensor  # [N] long
    group_size: int
    records: list[dict[str, Any]]
    eta: float
    guidance_scale: float = 1.0
    advantages: torch.Tensor | None = None  # [N], filled by the module
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return int(self.rewards.shape[0])

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }

    def to(self, device: torch.device | str) -> DiffusionBatch:
        return replace(self, **{name: t.to(device) for name, t in self._tensors().items()})

    def select(self, rows: torch.Tensor) -> DiffusionBatch:
        """The same batch restricted to ``rows`` (an index tensor, for mini-batches)."""
        picked = {name: t[rows.to(t.device)] for name, t in self._tensors().items()}
        return replace(self, **picked, records=[self.records[i] for i in rows.tolist()])

    @classmethod
    def collate(
        cls,
        groups: list[list[DiffusionRollout]],
        pad_token_id: int = 0,
        stats: dict[str, float] | None = None,
    ) -> DiffusionBatch:
        """Stack scored groups (all of one size, all with the same recorded steps) into one batch."""
        group_size = common_group_size(groups)
        rows = [r for g in groups for r in g]
        steps = {tuple(r.latents.shape) for r in rows}
        if len(steps) != 1:
            raise ValueError(
                f"every rollout of a batch must record the same SDE steps, got latent shapes {sorted(steps)}"
            )
        etas = {(r.eta, r.guidance_scale) for r in rows}
        if len(etas) != 1:
            raise ValueError(
                f"every rollout of a batch must share eta and guidance_scale, got {sorted(etas)}"
            )
        eta, guidance_scale = etas.pop()
        return cls(
            latents=torch.stack([r.latents for r in rows]),
            next_latents=torch.stack([r.next_latents for r in rows]),
            log_probs=torch.stack([r.log_probs for r in rows]),
            sigmas=torch.stack([r.sigmas for r in rows]),
            sigmas_next=torch.stack([r.sigmas_next for r in rows]),
            images=torch.from_numpy(np.stack([r.image for r in rows])),
            rewards=torch.tensor([r.reward for r in rows], dtype=torch.float32),
            weight_versions=torch.tensor([r.weight_version for r in rows], dtype=torch.long),
            gen_ids=torch.tensor([r.gen_id for r in rows], dtype=torch.long),
            group_size=group_size,
            records=[r.record for r in rows],
            eta=eta,
            guidance_scale=guidance_scale,
            stats=dict(stats or {}),
        )


class ImagePromptDataModule(LightningDataModule):
    """Prompt records for image policies: a prompt file, or built-in records for the tiny model.

    ``train_dataloader()`` yields ``list[dict]`` batches of ``batch_size`` records (last partial
    batch dropped); :meth:`val_records` returns the held-out records (the eval callback and the
    sample-image logging use them).

    Args:
        train: a prompt file: ``.txt`` (one prompt per line, as in Flow-GRPO's prompt sets),
            ``.jsonl`` or ``.parquet`` (field ``prompt_key``); None = built-in records:
            ``num_prompts`` records ``{"prompt": "colour k", "label": k}`` cycling over
            ``num_classes`` labels (``num_classes=0``: unconditional, ``{"prompt": ""}``).
        val: held-out prompt file; None = the built-in records (or the first ``num_val_prompts``
            of ``train``).
        batch_size: prompts per RL step.

    Example::

        ImagePromptDataModule(batch_size=4)                          # the tiny unconditional model
        ImagePromptDataModule(train="prompts/pickscore_train.txt", batch_size=8)
    """

    def __init__(
        self,
        train: str | None = None,
        val: str | None = None,
        batch_size: int = 4,
        num_prompts: int = 64,
        num_val_prompts: int = 8,
        num_classes: int = 0,
        prompt_key: str = "prompt",
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for key, value in (("batch_size", batch_size), ("num_prompts", num_prompts)):
            if value < 1:
                raise ValueError(f"ImagePromptDataModule {key} must be >= 1, got {value}")
        self.train_source, self.val_source = train, val
        self.batch_size = batch_size
        self.num_prompts, self.num_val_prompts = num_prompts, num_val_prompts
        self.num_classes = num_classes
        self.prompt_key = prompt_key
        self.shuffle, self.seed = shuffle, seed

    def _builtin(self, count: int) -> list[dict[str, Any]]:
        if not self.num_classes:
            return [{"prompt": ""} for _ in range(count)]
        return [
            {"prompt": f"colour {i % self.num_classes}", "label": i % self.num_classes} for i in range(count)
        ]

    def _load(self, source: str) -> list[dict[str, Any]]:
        path = Path(source).expanduser()
        if path.suffix.lower() == ".txt":
            if not path.is_file():
                raise FileNotFoundError(f"prompt file {source!r} does not exist (looked at {path.resolve()})")
            prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
            if not prompts:
                raise ValueError(f"prompt file {source!r} contains no prompts")
            return [{"prompt": p} for p in prompts]
        return load_records(source, prompt_key=self.prompt_key, answer_key=None)

    def train_records(self) -> list[dict[str, Any]]:
        records = (
            self._builtin(self.num_prompts) if self.train_source is None else self._load(self.train_source)
        )
        if len(records) < self.batch_size:
            raise ValueError(
                f"ImagePromptDataModule has {len(records)} training prompts, fewer than batch_size={self.batch_size}"
            )
        return records

    def val_records(self) -> list[dict[str, Any]]:
        if self.val_source is not None:
            return self._load(self.val_source)
        if self.train_source is None:
            return self._builtin(self.num_val_prompts)
        return self.train_records()[: self.num_val_prompts]

    def train_dataloader(self) -> DataLoader:
        return train_loader(self.train_records(), self.batch_size, self.shuffle, self.seed)


MAX_INFLIGHT_REASON = (
    "a diffusion rollout result is large (trajectory latents of every SDE step), and with a second request "
    "in flight a launch can block the transfer of the previous result (the reference implementation "
    "measured ~150 s instead of ~8 s per rollout); with one request in flight the poll-first loop reaps "
    "every ready result before the next launch. Async overlap comes from max_staleness >= 1: the next "
    "request generates while this step trains"
)


class FlowGRPOModule(RLModule):
    """Flow-GRPO: GRPO on the SDE steps of a flow-matching image model, with optional LoRA and KL.

    Args:
        policy: the model spec (:class:`TinyFlowModel` on CPU, :class:`SD3FlowModel` on GPU); every
            rollout engine builds the same spec.
        reward: an image reward (``unirl_lightning.rewards.image``) or any reward object; default
            :class:`~unirl_lightning.rewards.image.TargetColorReward` (red).
        rollout: the engine config (default: the diffusion engine on the policy).
        lora: LoRA adapters on the denoiser (only they train, only they are synced); None = full
            fine-tuning with full-weight sync.
        num_generations: images per prompt (the group size), ``>= 2``.
        num_steps / eta / sde_indices / guidance_scale: sampling (see
            :class:`~unirl_lightning.engines.diffusion.DiffusionSampling`); ``eta > 0`` to train.
        lr / weight_decay / betas: AdamW.
        clip_range: PPO clip range of the per-step ratio (Flow-GRPO uses 1e-4: a step's log-prob
            is a mean over latent elements, so ratios stay very close to 1).
        adv_clip_max: advantages are clipped to ``[-adv_clip_max, adv_clip_max]``.
        kl_coef: KL to the reference (the initial weights; with LoRA the adapter-free model):
            ``||mean - mean_ref||^2 / (2 std^2)`` per step, Flow-GRPO's estimator.
        timestep_fraction: fraction of the recorded SDE steps trained on per RL step (a random
            subset, as in Flow-GRPO); 1.0 = all.
        ppo_epochs / mini_batches: passes over each batch and optimizer steps per pass.
        max_grad_norm: gradient clipping through Lightning; 0 = off.
        log_images: images sampled with the ODE (fixed seeds) and logged to TensorBoard at the start
            and the end of training (``samples/before``, ``samples/after``); 0 = off.

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
        rollout: DiffusionEngineConfig | None = None,
        lora: LoraSpec | None = None,
        num_generations: int = 8,
        num_steps: int = 10,
        eta: float = 1.0,
        sde_indices: list[int] | None = None,
        guidance_scale: float = 1.0,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        clip_range: float = 1e-4,
        adv_clip_max: float = 5.0,
        kl_coef: float = 0.0,
        timestep_fraction: float = 1.0,
        ppo_epochs: int = 1,
        mini_batches: int = 1,
        max_grad_norm: float = 1.0,
        log_images: int = 8,
    ) -> None:
        super().__init__()
        if num_generations < 2:
            raise ValueError(
                f"num_generations must be >= 2 (advantages compare images of a group), got {num_generations}"
            )
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
        if not 0 < timestep_fraction <= 1:
            raise ValueError(f"timestep_fraction must be in (0, 1], got {timestep_fraction}")
        for key, value in (("ppo_epochs", ppo_epochs), ("mini_batches", mini_batches)):
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        if not 0 <= clip_range < 1:
            raise ValueError(f"clip_range must be in [0, 1), got {clip_range}")
        if log_images < 0:
            raise ValueError(f"log_images must be >= 0 (0 = off), got {log_images}")
        self.save_hyperparameters(ignore=["policy", "reward", "rollout", "lora"])
        self.policy_spec = policy or TinyFlowModel()
        self.pipeline = self.policy_spec.build()
        if guidance_scale != 1.0 and not self.pipeline.conditional:
            raise ValueError(
                f"guidance_scale={guidance_scale} needs a conditional model; this policy is unconditional"
            )
        self.lora = lora
        if lora is not None:
            self.pipeline.denoiser = apply_lora(self.pipeline.denoiser, lora, self.pipeline.arch)
        self.policy = self.pipeline.denoiser
        if reward is None:
            from unirl_lightning.rewards.image import TargetColorReward

            reward = TargetColorReward()
        self.reward = reward
        engine = rollout or DiffusionEngineConfig()
        if engine.lora is not None and engine.lora != lora:
            raise ValueError(
                f"rollout.lora={engine.lora} differs from the module's lora={lora}; set it on the module"
            )
        self.engine_config = replace(engine, policy=engine.policy or self.policy_spec, lora=lora)
        self.num_generations = num_generations
        self.clip_range, self.adv_clip_max = clip_range, adv_clip_max
        self.kl_coef, self.timestep_fraction = kl_coef, timestep_fraction
        self.ppo_epochs, self.mini_batches = ppo_epochs, mini_batches
        self.max_grad_norm = max_grad_norm
        self.log_images = log_images
        self.ref_policy: torch.nn.Module | None = None
        self.sample_images: dict[str, torch.Tensor] = {}  # "before" / "after": uint8 [k, H, W, 3]

    # -- what the strategy needs ----------------------------------------------------------------
    def rollout_spec(self) -> RolloutSpec:
        return RolloutSpec(
            engine_config=self.engine_config,
            reward=self.reward,
            num_generations=self.num_generations,
            sampling=self.sampling,
            pad_token_id=0,
            order="poll_first",
            collate=DiffusionBatch.collate,
        )

    def eval_sampling(self, temperature: float, max_new_tokens: int | None = None) -> DiffusionSampling:
        """Eval sampling: ``eta = temperature * eta`` (``temperature=0``: the deterministic ODE)."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = the deterministic ODE), got {temperature}")
        return replace(
            self.sampling,
            eta=temperature * self.sampling.eta,
            sde_indices=self.sampling.sde_indices if temperature > 0 else None,
        )

    # -- Lightning hooks ------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        max_inflight = getattr(self.trainer.strategy, "max_inflight", 1)
        if max_inflight > 1:
            raise ValueError(
                f"FlowGRPOModule needs AsyncRolloutStrategy(max_inflight=1), got max_inflight={max_inflight}: "
                f"{MAX_INFLIGHT_REASON}"
            )
        if self.kl_coef > 0 and self.lora is None and self.ref_policy is None:
            self.ref_policy = copy.deepcopy(self.policy).requires_grad_(False).eval()

    def on_fit_start(self) -> None:
        self.pipeline.to(self.device)  # the frozen parts (text encoders, VAE) that Lightning does not move
        if self.ref_policy is not None:
            self.ref_policy.to(self.device)

    def on_train_start(self) -> None:
        self._log_samples("before")

    def on_train_end(self) -> None:
        self._log_samples("after")

    # -- the update -----------------------------------------------------------------------------
    def _train_steps(self, num_steps: int) -> list[int]:
        """The recorded steps trained on this RL step: all, or a random ``timestep_fraction`` of them."""
        if self.timestep_fraction >= 1:
            return list(range(num_steps))
        count = max(1, round(num_steps * self.timestep_fraction))
        generator = torch.Generator().manual_seed(self.global_step)
        return sorted(torch.randperm(num_steps, generator=generator)[:count].tolist())

    def _reference_velocity(self, latents, sigma, cond, null_cond, guidance_scale) -> torch.Tensor:
        if self.lora is not None:
            with self.policy.disable_adapter():
                return guided_velocity(
                    self.pipeline, self.policy, latents, sigma, cond, null_cond, guidance_scale
                )
        return guided_velocity(
            self.pipeline, self.ref_policy, latents, sigma, cond, null_cond, guidance_scale
        )

    def replay_step(
        self,
        batch: DiffusionBatch,
        step: int,
        cond: dict[str, torch.Tensor],
        null_cond: dict[str, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Recompute recorded step ``step`` of every row with the trainer's weights; return (loss, metrics)."""
        latents, next_latents = batch.latents[:, step], batch.next_latents[:, step]
        sigma, sigma_next = batch.sigmas[:, step], batch.sigmas_next[:, step]
        velocity = guided_velocity(
            self.pipeline, self.policy, latents, sigma, cond, null_cond, batch.guidance_scale
        )
        _, logp, mean, std = sde_step(
            velocity, latents, sigma, sigma_next, batch.eta, prev_sample=next_latents
        )
        old_logp = batch.log_probs[:, step]
        every_row = torch.ones_like(logp[:, None])
        loss, metrics = ppo_clip_loss(
            logp[:, None], old_logp[:, None], batch.advantages, every_row, self.clip_range, self.clip_range
        )
        with torch.no_grad():
            log_ratio = logp - old_logp
            metrics["ratio_dev_max"] = (torch.exp(log_ratio) - 1).abs().max()
            metrics["logp_diff_abs"] = log_ratio.abs().mean()
        if self.kl_coef > 0:
            with torch.no_grad():
                ref_velocity = self._reference_velocity(latents, sigma, cond, null_cond, batch.guidance_scale)
                _, _, ref_mean, _ = sde_step(
                    ref_velocity, latents, sigma, sigma_next, batch.eta, prev_sample=next_latents
                )
            # KL of two Gaussians with the same std, per latent element (Flow-GRPO's estimator)
            kl = ((mean - ref_mean) ** 2 / (2 * std**2)).mean(dim=tuple(range(1, mean.dim()))).mean()
            loss = loss + self.kl_coef * kl
            metrics["kl"] = kl.detach()
        return loss, metrics

    def training_step(self, batch: DiffusionBatch, batch_idx: int) -> torch.Tensor:
        start = time.perf_counter()
        optimizer = self.optimizers()
        advantages = group_advantages(batch.rewards, batch.group_size, normalize="std")
        batch.advantages = advantages.clamp(-self.adv_clip_max, self.adv_clip_max)
        cond = self.pipeline.encode(batch.records, self.device)
        null_cond = (
            self.pipeline.encode_null(batch.num_rows, self.device) if batch.guidance_scale != 1.0 else None
        )
        train_steps = self._train_steps(batch.log_probs.shape[1])

        rows = torch.arange(batch.num_rows, device=batch.rewards.device)
        first: dict[str, torch.Tensor] = {}
        for _epoch in range(self.ppo_epochs):
            for mb in rows.chunk(self.mini_batches):
                mini = batch.select(mb)
                mini_cond = {k: v[mb] for k, v in cond.items()}
                mini_null = None if null_cond is None else {k: v[mb] for k, v in null_cond.items()}
                optimizer.zero_grad()
                per_step = []
                for step in train_steps:  # one backward per step: memory stays that of one denoiser call
                    loss, metrics = self.replay_step(mini, step, mini_cond, mini_null)
                    self.manual_backward(loss / len(train_steps))
                    per_step.append({**metrics, "loss": loss.detach()})
                if self.max_grad_norm > 0:
                    self.clip_gradients(
                        optimizer, gradient_clip_val=self.max_grad_norm, gradient_clip_algorithm="norm"
                    )
                optimizer.step()
                if not first:  # the first mini-batch is replayed before any update of this step
                    first = {k: torch.stack([m[k] for m in per_step]).mean() for k in per_step[0]}
                    first["ratio_dev_max"] = torch.stack([m["ratio_dev_max"] for m in per_step]).max()

        n = batch.num_rows
        self.log_rollout_stats(batch)
        self.log("rollout/reward_std", batch.rewards.std(), batch_size=n)
        self.log_dict({f"train/{k}": v for k, v in first.items()}, batch_size=n)
        self.log("perf/train_time_s", time.perf_counter() - start, batch_size=n)
        return first["loss"]

    # -- sample images before / after -----------------------------------------------------------
    def _sample_records(self) -> list[dict[str, Any]]:
        datamodule = getattr(self.trainer, "datamodule", None)
        for source in ("val_records", "train_records"):
            records = list(getattr(datamodule, source, lambda: [])() or [])
            if records:
                return records[: self.log_images]
        return [{"prompt": ""}]

    def _log_samples(self, tag: str) -> None:
        """ODE samples at fixed seeds from the workers (read-only), logged as ``samples/<tag>``."""
        evaluate = getattr(self.trainer.strategy, "evaluate", None)
        if not self.log_images or evaluate is None:
            return
        records = self._sample_records()
        per_record = math.ceil(self.log_images / len(records))
        groups = evaluate(records, self.eval_sampling(0.0), n=per_record, seed=0)
        images = torch.from_numpy(np.stack([r.image for g in groups for r in g][: self.log_images]))
        self.sample_images[tag] = images
        for logger in self.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_images"):
                experiment.add_images(f"samples/{tag}", images, self.global_step, dataformats="NHWC")
