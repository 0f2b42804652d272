"""GRPOModule: group-relative policy optimisation for causal LMs, in Lightning.

``training_step`` receives an :class:`~unirl_lightning.rollout.types.ExperienceBatch` (``n`` scored
completions per prompt, with behaviour log-probs and launch-time weight versions) from the
strategy's RolloutLoop and runs, in this order: group-normalised advantages -> ``ppo_epochs`` x
mini-batches of [recompute log-probs -> PPO-clip loss (+ KL to a frozen reference) -> backward ->
clip -> step]. All math is in :mod:`unirl_lightning.algorithms`.

Off-policy handling: by default the PPO ratio is taken against the behaviour log-probs the engine
recorded (``old_logprob="rollout"``), so clipping bounds the update relative to the policy that
actually generated the data, stale or not. ``old_logprob="recompute"`` takes the ratio against the
trainer's own log-probs before the update (decoupled PPO) and, with ``tis_cap``, reweights every
token by the truncated importance weight ``min(pi_trainer / pi_rollout, tis_cap)``.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any

import torch

from unirl_lightning.algorithms import (
    group_advantages,
    kl_penalty,
    masked_mean,
    ppo_clip_loss,
    rloo_advantages,
    token_logprobs,
    truncated_importance_weights,
)
from unirl_lightning.engines import resolve_engine_config
from unirl_lightning.engines.hf import HFEngineConfig
from unirl_lightning.engines.sglang import SGLangEngineConfig
from unirl_lightning.engines.vllm import VLLMEngineConfig
from unirl_lightning.lora import LLM_LORA_TARGETS, LoraSpec, apply_lora
from unirl_lightning.models import PretrainedCausalLM, TinyCausalLM
from unirl_lightning.modules.base import RLModule, RolloutSpec
from unirl_lightning.rewards import ExactMatchReward, Reward, resolve_reward
from unirl_lightning.rollout.types import ExperienceBatch, SamplingParams

ADVANTAGES = ("grpo", "dr_grpo", "rloo")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
OLD_LOGPROBS = ("rollout", "recompute")


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{key} must be one of {allowed}, got {value!r}")
    return value


class GRPOModule(RLModule):
    """GRPO / Dr.GRPO / RLOO with PPO-clip, DAPO clip-higher, optional KL and truncated IS.

    Args:
        policy: what to train; also what every rollout engine builds before weights are pushed.
        reward: a reward object (``unirl_lightning.rewards``) or an import path ``"pkg.mod:func"`` of a
            per-sample callable ``func(completion, record) -> float``; default: exact match.
        rollout: the engine: ``"hf"`` (default), ``"vllm"``, ``"sglang"`` or an engine config; its
            policy and LoRA are filled in from this module.
        lora: train ``peft`` LoRA adapters instead of all weights; only adapters are pushed.
        num_generations: completions per prompt (the group size).
        temperature / top_p / max_new_tokens: sampling; log-probs are recomputed at ``temperature``.
        lr / weight_decay / betas: AdamW.
        advantage: ``"grpo"`` (std-normalised), ``"dr_grpo"`` (mean-centred), ``"rloo"``.
        clip_low / clip_high: PPO clip range ``[1 - clip_low, 1 + clip_high]`` (clip-higher: 0.28).
        loss_aggregation: ``"token-mean"``, ``"seq-mean-token-mean"`` or ``"seq-mean-token-sum-norm"``.
        kl_coef / kl_estimator: KL to a frozen copy of the initial policy (``"k1"``, ``"k2"``, ``"k3"``).
        old_logprob: ``"rollout"`` or ``"recompute"`` (see the module docstring).
        tis_cap: truncated importance-sampling cap (``old_logprob="recompute"`` only); None = off.
        ppo_epochs / mini_batches: passes over each rollout batch and optimizer steps per pass.
        max_grad_norm: gradient clipping through Lightning (``clip_gradients``); 0 = off.

    Example::

        module = GRPOModule(policy=TinyCausalLM(), reward=ExactMatchReward(), num_generations=8,
                            max_new_tokens=2, lr=3e-3)
    """

    def __init__(
        self,
        policy: TinyCausalLM | PretrainedCausalLM | None = None,
        reward: Reward | str | None = None,
        rollout: HFEngineConfig | VLLMEngineConfig | SGLangEngineConfig | str | None = None,
        lora: LoraSpec | None = None,
        num_generations: int = 8,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 16,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        advantage: str = "grpo",
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        loss_aggregation: str = "token-mean",
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        old_logprob: str = "rollout",
        tis_cap: float | None = None,
        ppo_epochs: int = 1,
        mini_batches: int = 1,
        max_grad_norm: float = 1.0,
    ) -> None:
        super().__init__()
        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}")
        if advantage != "dr_grpo" and num_generations < 2:
            raise ValueError(
                f"advantage={advantage!r} compares samples within a group: num_generations must be >= 2"
            )
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for training rollouts, got {temperature}")
        for key, value in (("ppo_epochs", ppo_epochs), ("mini_batches", mini_batches)):
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.advantage = _choice("advantage", advantage, ADVANTAGES)
        self.loss_aggregation = _choice("loss_aggregation", loss_aggregation, AGGREGATIONS)
        self.old_logprob = _choice("old_logprob", old_logprob, OLD_LOGPROBS)
        if tis_cap is not None and old_logprob != "recompute":
            raise ValueError(
                "tis_cap needs old_logprob='recompute' (the weights are pi_trainer / pi_rollout)"
            )
        self.save_hyperparameters(ignore=["policy", "reward", "rollout", "lora"])
        self.policy_spec = policy or TinyCausalLM()
        self.policy, self.tokenizer = self.policy_spec.build()
        self.lora = lora
        if lora is not None:  # only the adapters train, and only they are pushed to the engines
            self.policy = apply_lora(self.policy, lora, LLM_LORA_TARGETS)
        self.reward = resolve_reward(reward) if reward is not None else ExactMatchReward()
        engine = resolve_engine_config(rollout if rollout is not None else "hf")
        if getattr(engine, "lora", None) not in (None, lora):
            raise ValueError(
                f"rollout.lora={engine.lora} differs from the module's lora={lora}; set it on the module only"
            )
        # engines build the trained policy and wrap it with the same adapters
        self.engine_config = dataclasses.replace(engine, policy=engine.policy or self.policy_spec, lora=lora)
        self.sampling = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
        self.num_generations = num_generations
        self.clip_low, self.clip_high = clip_low, clip_high
        self.kl_coef, self.kl_estimator = kl_coef, kl_estimator
        self.tis_cap = tis_cap
        self.ppo_epochs, self.mini_batches = ppo_epochs, mini_batches
        self.max_grad_norm = max_grad_norm
        self.ref_policy = None

    # -- what the strategy needs ----------------------------------------------------------------
    def rollout_spec(self) -> RolloutSpec:
        return RolloutSpec(
            engine_config=self.engine_config,
            reward=self.reward,
            num_generations=self.num_generations,
            sampling=self.sampling,
            pad_token_id=self.tokenizer.pad_token_id,
        )

    def eval_sampling(self, temperature: float, max_new_tokens: int | None) -> SamplingParams:
        return SamplingParams(
            temperature=temperature, max_new_tokens=max_new_tokens or self.sampling.max_new_tokens
        )

    # -- Lightning hooks ------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        # the KL reference: a frozen copy of the initial policy (with LoRA: the same model, adapters off)
        if self.kl_coef > 0 and self.ref_policy is None and self.lora is None:
            self.ref_policy = copy.deepcopy(self.policy).requires_grad_(False).eval()

    def reference_logprobs(self, batch: ExperienceBatch) -> torch.Tensor | None:
        if self.kl_coef == 0:
            return None
        if self.lora is not None:
            with self.policy.disable_adapter():
                return self.sequence_logprobs(self.policy, batch)
        return self.sequence_logprobs(self.ref_policy, batch)

    def sequence_logprobs(self, model: torch.nn.Module, batch: ExperienceBatch) -> torch.Tensor:
        """Log-prob of every next token, ``[N, L-1]``, at the sampling temperature."""
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        return token_logprobs(logits[:, :-1], batch.input_ids[:, 1:], self.sampling.temperature)

    def compute_advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        if self.advantage == "rloo":
            return rloo_advantages(rewards, group_size)
        return group_advantages(rewards, group_size, normalize="std" if self.advantage == "grpo" else "mean")

    def policy_loss(
        self,
        minibatch: ExperienceBatch,
        advantages: torch.Tensor,
        prox_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """PPO-clip loss (+ ``kl_coef`` x KL to the reference) of one mini-batch, with its metrics.

        ``advantages`` are per row ``[B]`` or per token ``[B, L-1]``; ``prox_logp`` (the trainer's
        log-probs before this step, ``old_logprob="recompute"``) and ``ref_logp`` are this
        mini-batch's rows, or None.
        """
        mask = minibatch.response_mask[:, 1:]
        rollout_logp = minibatch.rollout_logprobs[:, 1:]
        logp = self.sequence_logprobs(self.policy, minibatch)
        old_logp = rollout_logp if prox_logp is None else prox_logp
        is_weights = None
        if self.tis_cap is not None:  # pi_trainer / pi_rollout, truncated (TIS)
            is_weights = truncated_importance_weights(prox_logp, rollout_logp, mask, self.tis_cap)
        pg_loss, metrics = ppo_clip_loss(
            logp, old_logp, advantages, mask, self.clip_low, self.clip_high, self.loss_aggregation, is_weights
        )
        metrics["pg_loss"] = pg_loss.detach()
        metrics["logp_diff_abs"] = masked_mean((logp.detach() - rollout_logp).abs(), mask)
        if ref_logp is None:
            return pg_loss, metrics
        kl = masked_mean(kl_penalty(logp, ref_logp, self.kl_estimator), mask)
        metrics["kl"] = kl.detach()
        return pg_loss + self.kl_coef * kl, metrics

    def optimizer_step(self, optimizer: Any, loss: torch.Tensor) -> None:
        """zero_grad -> backward -> clip (through Lightning) -> step."""
        optimizer.zero_grad()
        self.manual_backward(loss)
        if self.max_grad_norm > 0:
            self.clip_gradients(
                optimizer, gradient_clip_val=self.max_grad_norm, gradient_clip_algorithm="norm"
            )
        optimizer.step()

    def training_step(self, batch: ExperienceBatch, batch_idx: int) -> torch.Tensor:
        start = time.perf_counter()
        optimizer = self.optimizers()
        batch.advantages = self.compute_advantages(batch.rewards, batch.group_size)
        with torch.no_grad():
            prox_logp = (
                self.sequence_logprobs(self.policy, batch) if self.old_logprob == "recompute" else None
            )
            ref_logp = self.reference_logprobs(batch)

        rows = torch.arange(batch.num_rows, device=batch.input_ids.device)
        first: dict[str, torch.Tensor] = {}
        for _epoch in range(self.ppo_epochs):
            for mb in rows.chunk(self.mini_batches):
                loss, metrics = self.policy_loss(
                    batch.select(mb), batch.advantages[mb], _rows(prox_logp, mb), _rows(ref_logp, mb)
                )
                self.optimizer_step(optimizer, loss)
                if not first:  # the first mini-batch is the one taken before any update of this step
                    first = {**metrics, "loss": loss.detach()}

        n = batch.num_rows
        self.log_rollout_stats(batch)
        self.log_dict({f"train/{k}": v for k, v in first.items()}, batch_size=n)
        self.log("perf/train_time_s", time.perf_counter() - start, batch_size=n)
        return first["loss"]


def _rows(tensor: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if tensor is None else tensor[rows]
