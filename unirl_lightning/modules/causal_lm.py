"""CausalLMModule: what GRPO and PPO on a causal LM share, on the policy-gradient base.

The policy (built from its spec, optionally wrapped in LoRA adapters), the sampling, the trainer's
log-probs of the sampled tokens at the sampling temperature, the reference log-probs for a KL
term, and the token-level PPO-clip loss with its off-policy handling:

* ``old_logprob="rollout"`` (default): the PPO ratio is taken against the behaviour log-probs the
  engine recorded, so clipping bounds the update relative to the policy that actually generated
  the data, stale or not.
* ``old_logprob="recompute"``: the ratio is taken against the trainer's own log-probs before the
  update (decoupled PPO) and, with ``tis_cap``, every token is reweighted by the truncated
  importance weight ``min(pi_trainer / pi_rollout, tis_cap)``.

Subclasses (:class:`~unirl_lightning.modules.grpo.GRPOModule`,
:class:`~unirl_lightning.modules.ppo.PPOModule`) add their advantages.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Literal

import torch

from unirl_lightning.algorithms import (
    LossAggregation,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
    ppo_clip_loss,
    token_logprobs,
    truncated_importance_weights,
)
from unirl_lightning.algorithms.kl import KLEstimator
from unirl_lightning.checks import require_at_least, require_choice, require_in_range
from unirl_lightning.lora import LLM_LORA_TARGETS, LoraSpec, apply_lora, unwrapped
from unirl_lightning.models import PretrainedCausalLM, TinyCausalLM
from unirl_lightning.modules.base import PolicyGradientModule, RolloutSpec
from unirl_lightning.rewards import ExactMatchReward, Reward, resolve_reward
from unirl_lightning.rollout.types import ExperienceBatch, SamplingParams
from unirl_lightning.sharding import shard_children

OldLogprob = Literal["rollout", "recompute"]


class CausalLMModule(PolicyGradientModule):
    """A causal-LM policy trained with a token-level PPO-clip loss (see the module docstring).

    Args:
        policy: what to train; also what every rollout engine builds before weights are pushed.
        reward: a reward object (``unirl_lightning.rewards``) or an import path ``"pkg.mod:func"`` of a
            per-sample callable ``func(completion, record) -> float``; default: exact match.
        lora: train ``peft`` LoRA adapters instead of all weights; only adapters are pushed.
        num_generations: completions per prompt (the group size).
        temperature / top_p / max_new_tokens: sampling; log-probs are recomputed at ``temperature``.
        lr / weight_decay / betas: AdamW.
        clip_low / clip_high: PPO clip range ``[1 - clip_low, 1 + clip_high]`` (clip-higher: 0.28).
        loss_aggregation: ``"token-mean"``, ``"seq-mean-token-mean"`` or ``"seq-mean-token-sum-norm"``.
        kl_coef / kl_estimator: KL to a frozen copy of the initial policy (``"k1"``, ``"k2"``, ``"k3"``).
        old_logprob: ``"rollout"`` or ``"recompute"`` (see the module docstring).
        tis_cap: truncated importance-sampling cap (``old_logprob="recompute"`` only); None = off.
        ppo_epochs / mini_batches: passes over each rollout batch and optimizer steps per pass.
        max_grad_norm: gradient clipping through Lightning (``clip_gradients``); 0 = off.
    """

    def __init__(
        self,
        policy: TinyCausalLM | PretrainedCausalLM | None = None,
        reward: Reward | str | None = None,
        lora: LoraSpec | None = None,
        num_generations: int = 8,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 16,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        loss_aggregation: LossAggregation = "token-mean",
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        old_logprob: OldLogprob = "rollout",
        tis_cap: float | None = None,
        ppo_epochs: int = 1,
        mini_batches: int = 1,
        max_grad_norm: float = 1.0,
    ) -> None:
        super().__init__(lr, weight_decay, betas, ppo_epochs, mini_batches, max_grad_norm, kl_coef)
        require_at_least("num_generations", num_generations, 1)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 for training rollouts, got {temperature!r}")
        require_in_range("clip_low", clip_low, 0, 1, high_open=True)
        require_at_least("clip_high", clip_high, 0)
        self.loss_aggregation = require_choice("loss_aggregation", loss_aggregation, LossAggregation)
        self.kl_estimator = require_choice("kl_estimator", kl_estimator, KLEstimator)
        self.old_logprob = require_choice("old_logprob", old_logprob, OldLogprob)
        if tis_cap is not None and old_logprob != "recompute":
            raise ValueError(
                f"tis_cap needs old_logprob='recompute' (the weights are pi_trainer / pi_rollout), got "
                f"old_logprob={old_logprob!r}"
            )
        self.save_hyperparameters(ignore=["policy", "reward", "lora"])
        self.policy_spec = policy or TinyCausalLM()
        self.policy, self.tokenizer = self.policy_spec.build()
        self.lora = lora
        if lora is not None:  # only the adapters train, and only they are pushed to the engines
            self.policy = apply_lora(self.policy, lora, LLM_LORA_TARGETS)
        self.reward = resolve_reward(reward) if reward is not None else ExactMatchReward()
        self.sampling = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
        self.num_generations = num_generations
        self.clip_low, self.clip_high = clip_low, clip_high
        self.tis_cap = tis_cap

    # -- what the strategy needs ----------------------------------------------------------------
    def rollout_spec(self) -> RolloutSpec:
        return RolloutSpec(
            policy=self.policy_spec,
            lora=self.lora,
            reward=self.reward,
            num_generations=self.num_generations,
            sampling=self.sampling,
            collate=functools.partial(ExperienceBatch.collate, pad_token_id=self.tokenizer.pad_token_id),
            family="token",
        )

    def configure_model(self) -> None:
        """Under a sharding strategy (``AsyncRolloutFSDPStrategy``: Lightning gives the module a
        device mesh) every network of the module is sharded with FSDP2, one shard group per
        transformer block; otherwise nothing happens."""
        if self.device_mesh is not None:
            shard_children(self, self.device_mesh)

    def eval_sampling(self, temperature: float) -> SamplingParams:
        return SamplingParams(temperature=temperature, max_new_tokens=self.sampling.max_new_tokens)

    # -- log-probs ------------------------------------------------------------------------------
    def sequence_logprobs(
        self, model: torch.nn.Module, batch: ExperienceBatch, entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Log-prob of every next token, ``[N, L-1]``, at the sampling temperature (with
        ``entropy=True`` also the policy's entropy at every position, detached).

        Only positions from the batch's first response token on get logits (``logits_to_keep``
        where the model takes it): the vocabulary projection of prompt positions, most of a real
        model's logits (49k x width per position for SmolLM2), is never computed; earlier
        positions read 0 (they are masked out of every loss)."""
        width = batch.input_ids.shape[1]
        start = first_response_column(batch.response_mask) if accepts_logits_to_keep(model) else 0
        kwargs = {"logits_to_keep": width - start} if start > 0 else {}
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **kwargs).logits
        logits = logits[:, -(width - start) :][:, :-1]  # positions start .. L-2 predict tokens start+1 .. L-1
        logp = token_logprobs(logits, batch.input_ids[:, start + 1 :], self.sampling.temperature)
        if start > 0:
            logp = torch.nn.functional.pad(logp, (start, 0))
        if not entropy:
            return logp
        with torch.no_grad():
            ent = entropy_from_logits(logits, self.sampling.temperature)
            return logp, torch.nn.functional.pad(ent, (start, 0)) if start > 0 else ent

    @torch.no_grad()
    def prepare_batch(self, batch: ExperienceBatch) -> dict[str, Any]:
        """The trainer's log-probs before this step (``old_logprob="recompute"``) and the reference's
        (with a KL term); a subclass adds ``advantages``."""
        context: dict[str, Any] = {"prox_logp": None, "ref_logp": None}
        if self.old_logprob == "recompute":
            context["prox_logp"] = self.sequence_logprobs(self.policy, batch)
        if self.kl_coef > 0:
            with self.reference_policy() as reference:
                context["ref_logp"] = self.sequence_logprobs(reference, batch)
        return context

    def policy_loss(
        self, minibatch: ExperienceBatch, context: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """PPO-clip loss (+ ``kl_coef`` x per-token KL to the reference) of one mini-batch, with its metrics.

        ``context["advantages"]`` are per row ``[B]`` or per token ``[B, L-1]``; ``prox_logp`` and
        ``ref_logp`` are this mini-batch's rows, or None.
        """
        mask = minibatch.response_mask[:, 1:]
        rollout_logp = minibatch.rollout_logprobs[:, 1:]
        prox_logp, ref_logp = context["prox_logp"], context["ref_logp"]
        entropy = None
        if self.first_minibatch:  # the logged mini-batch: the entropy too (a pass over the vocabulary)
            logp, entropy = self.sequence_logprobs(self.policy, minibatch, entropy=True)
        else:
            logp = self.sequence_logprobs(self.policy, minibatch)
        old_logp = rollout_logp if prox_logp is None else prox_logp
        is_weights = None
        if self.tis_cap is not None:  # pi_trainer / pi_rollout, truncated (TIS)
            is_weights = truncated_importance_weights(prox_logp, rollout_logp, mask, self.tis_cap)
        kl = None if ref_logp is None else kl_penalty(logp, ref_logp, self.kl_estimator, mask=mask)
        # the KL is added per token before aggregation (TRL, verl), so every aggregation weighs it alike
        loss, metrics = ppo_clip_loss(
            logp,
            old_logp,
            context["advantages"],
            mask,
            self.clip_low,
            self.clip_high,
            self.loss_aggregation,
            is_weights,
            max_tokens=self.sampling.max_new_tokens,
            token_penalty=None if kl is None else self.kl_coef * kl,
        )
        metrics["logp_diff_abs"] = masked_mean((logp.detach() - rollout_logp).abs(), mask)
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy, mask)
        if kl is not None:
            metrics["kl"] = masked_mean(kl.detach(), mask)
        return loss, metrics


def first_response_column(response_mask: torch.Tensor) -> int:
    """The first column ``t`` of ``[N, L-1]`` next-token log-probs that any row trains on (the
    position before the earliest response token); 0 when the mask is empty."""
    columns = response_mask[:, 1:].any(dim=0).nonzero()
    return int(columns[0]) if len(columns) else 0


def accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the (PEFT-unwrapped) ``transformers`` model computes logits for the last positions only."""
    return "logits_to_keep" in inspect.signature(unwrapped(model).forward).parameters
