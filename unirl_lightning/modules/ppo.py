"""PPOModule: actor-critic PPO with token-level GAE for causal LMs, in Lightning.

``training_step`` receives an :class:`~unirl_lightning.rollout.batches.ExperienceBatch` from the
strategy's RolloutLoop and runs, in this order: critic values ``V(s_t)`` for every completion token ->
the sequence's reward placed on its last completion token -> GAE advantages and returns (Schulman et
al. 2016) -> advantage whitening over the valid tokens -> ``ppo_epochs`` x mini-batches of [recompute
log-probs and values -> PPO-clip loss + ``vf_coef`` x clipped value loss (+ KL to a frozen reference)
-> backward -> clip -> step]. All math is in :mod:`unirl_lightning.algorithms` or named below.

Contract: the critic (:class:`ValueModel`) is a second copy of the policy's backbone, built from the
same policy spec, with a scalar head on the last hidden state. It lives in ``self.critic``, never in
``self.policy``, so the strategy pushes the policy alone to the rollout workers; it is in the module's
``state_dict`` (checkpoints) and in the one AdamW optimizer (its own param group at ``critic_lr``).
Everything else (policy, reward, sampling, KL reference, ``old_logprob`` / ``tis_cap``, the loss) is
:class:`~unirl_lightning.modules.causal_lm.CausalLMModule`'s, which GRPOModule shares: PPO is a
sibling of GRPO, with a critic instead of group advantages. Bad arguments raise ``ValueError``
naming the argument, the value and what is allowed, before any model is built.
"""

from __future__ import annotations

from typing import Any

import torch

from unirl_lightning.algorithms import (
    clipped_value_loss,
    explained_variance,
    gae_advantages,
    last_token_rewards,
    masked_mean,
    masked_whiten,
)
from unirl_lightning.core.checks import require_at_least, require_in_range, require_positive
from unirl_lightning.models.lora import LLM_LORA_TARGETS, apply_lora
from unirl_lightning.modules.causal_lm import CausalLMModule
from unirl_lightning.modules.context import PPOContext
from unirl_lightning.modules.tokens import enable_gradient_checkpointing
from unirl_lightning.rollout.batches import ExperienceBatch

__all__ = ["PPOModule", "ValueModel"]


class ValueModel(torch.nn.Module):
    """The critic: a causal LM's decoder (no LM head) with a linear value head on the last hidden state.

    ``forward`` returns ``V`` at every position, ``[N, L]``, float32 whatever the backbone's dtype. The
    head starts at zero (``V = 0`` everywhere), so the first advantages are the plain returns.
    """

    def __init__(self, backbone: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # the head in its own weights' dtype (the float32 master, or bf16 when FSDP2 gathers in bf16), not
        # autocast's, and V in float32 whatever the backbone computed in
        with torch.autocast(hidden.device.type, enabled=False):
            return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()


class PPOModule(CausalLMModule):
    """PPO (Schulman et al. 2017) with a learned critic and token-level GAE, for causal LMs.

    Args:
        gamma: GAE discount over completion tokens, in ``[0, 1]``; 1 is usual for LMs (one reward
            per sequence, on its last token).
        lam: GAE lambda, in ``[0, 1]``: 1 = Monte-Carlo returns minus ``V``, 0 = one-step TD.
        vf_coef: weight of the value loss in ``loss = pg_loss + vf_coef * vf_loss (+ kl_coef * kl)``, ``>= 0``.
        value_clip: clip the new values to ``old_values +- value_clip`` in the value loss (PPO2);
            ``None`` = unclipped. ``> 0``.
        critic_lr: learning rate of the critic's param group; ``None`` = ``lr``.
        whiten_advantages: normalise the GAE advantages to mean 0 / std 1 over the batch's valid tokens.
        **kwargs: every :class:`~unirl_lightning.modules.causal_lm.CausalLMModule` argument
            (``policy``, ``reward``, ``lora``, ``num_generations``, sampling, AdamW,
            ``loss``, ``clip_low``/``clip_high``/``clip_ratio_c``, ``cispo_cap``, ``loss_aggregation``
            (also used for the value loss), ``kl_coef``/``kl_estimator``, ``entropy_coef``,
            ``old_logprob``/``tis_cap``/``sequence_mask_cap``, ``mask_truncated`` (also masks the
            value loss), ``overlong_buffer``/``overlong_penalty`` (added to the reward on the last
            token), ``ppo_epochs``/``mini_batches``, ``max_grad_norm``, ``micro_batch_tokens``/
            ``micro_batch_rows`` (the critic's forwards and backward are split alike),
            ``gradient_checkpointing`` (also of the critic's backbone); ``ratio_level`` only
            ``"token"``); advantages come from the critic, so ``num_generations`` may be 1.
            With ``lora``, the critic's backbone gets the same adapters (only they and the value
            head train).

    Example::

        module = PPOModule(policy=TinyCausalLM(), reward=ExactMatchReward(), num_generations=4,
                           max_new_tokens=2, lr=3e-3, gamma=1.0, lam=0.95, vf_coef=0.1)
    """

    def __init__(
        self,
        gamma: float = 1.0,
        lam: float = 0.95,
        vf_coef: float = 0.1,
        value_clip: float | None = 0.2,
        critic_lr: float | None = None,
        whiten_advantages: bool = True,
        **kwargs: Any,
    ) -> None:
        if "advantage" in kwargs:
            raise ValueError(
                f"advantage must not be given to PPOModule (it estimates advantages with GAE and a critic: "
                f"gamma, lam), got advantage={kwargs['advantage']!r}"
            )
        if kwargs.get("ratio_level", "token") != "token":
            raise ValueError(
                "ratio_level='sequence' (GSPO) needs one advantage per sequence; PPOModule's GAE advantages "
                f"are per token: use ratio_level='token', got ratio_level={kwargs['ratio_level']!r}"
            )
        require_in_range("gamma", gamma, 0, 1)
        require_in_range("lam", lam, 0, 1)
        require_at_least("vf_coef", vf_coef, 0)
        if value_clip is not None:
            require_positive("value_clip", value_clip)
        if critic_lr is not None:
            require_positive("critic_lr", critic_lr)
        super().__init__(**kwargs)
        self.gamma, self.lam = gamma, lam
        self.vf_coef, self.value_clip = vf_coef, value_clip
        self.critic_lr = critic_lr if critic_lr is not None else self.lr
        self.whiten_advantages = whiten_advantages
        # the critic: a second backbone from the same spec (same init), not part of self.policy
        model, _ = self.build_policy()  # on the meta device where the policy is (filled with it)
        backbone = model.base_model  # the decoder without its LM head (LlamaModel for LlamaForCausalLM)
        if self.lora is not None:
            backbone = apply_lora(backbone, self.lora, LLM_LORA_TARGETS)
        if self.gradient_checkpointing:
            enable_gradient_checkpointing(backbone)
        self.critic = ValueModel(backbone, model.config.hidden_size)

    def build_optimizer(self) -> torch.optim.Optimizer:
        """The base AdamW over the policy, plus the critic's trainable parameters as a second param
        group at ``critic_lr`` (one optimizer: one step, one gradient clip, one schedule over both)."""
        optimizer = super().build_optimizer()
        optimizer.add_param_group(
            {"params": [p for p in self.critic.parameters() if p.requires_grad], "lr": self.critic_lr}
        )
        return optimizer

    def token_values(self, batch: ExperienceBatch) -> torch.Tensor:
        """``V(s_t)`` for the state that emits token ``t + 1``, ``[N, L-1]``, aligned with ``sequence_logprobs``."""
        with self.autocast(batch.input_ids.device.type):  # low-dtype compute over float32 masters
            values = self.critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        return values[:, :-1]

    @torch.no_grad()
    def prepare_batch(self, batch: ExperienceBatch) -> PPOContext:
        context = PPOContext(**vars(super().prepare_batch(batch)))
        mask = batch.response_mask[:, 1:]
        old_values = self.per_micro_batch(batch, self.token_values)  # a micro-batch at a time
        # one score per sequence (with the overlong penalty if any), on its last token
        rewards = last_token_rewards(self.sequence_rewards(batch), mask)
        advantages, returns = gae_advantages(rewards, old_values, mask, self.gamma, self.lam)
        if self.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
        batch.stats["train/value_mean"] = float(masked_mean(old_values, mask))  # logged with the step
        batch.stats["train/explained_variance"] = float(explained_variance(old_values, returns, mask))
        context.advantages, context.old_values, context.returns = advantages, old_values, returns
        return context

    def minibatch_loss(
        self, minibatch: ExperienceBatch, context: PPOContext
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        policy_loss, metrics = self.policy_loss(minibatch, context)
        vf_loss, vf_clip_fraction = clipped_value_loss(
            self.token_values(minibatch),
            context.old_values,
            context.returns,
            self.loss_mask(minibatch, context),
            self.value_clip,
            self.loss_settings.loss_aggregation,
            max_tokens=self.sampling.max_new_tokens,
        )
        metrics.update(vf_loss=vf_loss.detach(), vf_clip_fraction=vf_clip_fraction)
        return policy_loss + self.vf_coef * vf_loss, metrics
