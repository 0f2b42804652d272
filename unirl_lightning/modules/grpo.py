"""GRPOModule: group-relative policy optimisation for causal LMs, in Lightning.

``training_step`` receives an :class:`~unirl_lightning.rollout.batches.ExperienceBatch` (``n`` scored
completions per prompt, with behaviour log-probs and launch-time weight versions) from the
strategy's RolloutLoop and runs, in this order: group-relative advantages -> ``ppo_epochs`` x
mini-batches of [recompute log-probs -> PPO-clip loss (+ KL to a frozen reference) -> backward ->
clip -> step]. The update loop is :class:`~unirl_lightning.modules.base.PolicyGradientModule`'s,
the loss :class:`~unirl_lightning.modules.causal_lm.CausalLMModule`'s, the math
:mod:`unirl_lightning.algorithms`'.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

import torch

from unirl_lightning.algorithms import GroupStd, group_advantages, rloo_advantages
from unirl_lightning.core.checks import require_at_least, require_choice
from unirl_lightning.modules.causal_lm import CausalLMModule
from unirl_lightning.modules.context import TokenContext
from unirl_lightning.modules.spec import RolloutSpec
from unirl_lightning.rollout.batches import ExperienceBatch

Advantage = Literal["grpo", "dr_grpo", "rloo"]


class GRPOModule(CausalLMModule):
    """GRPO / Dr.GRPO / RLOO with PPO-clip (or GSPO, CISPO), DAPO clip-higher and overlong handling,
    optional KL, entropy bonus and rollout/trainer mismatch correction.

    Args:
        advantage: ``"grpo"`` (reward minus the group mean, over the group's std + 1e-4, as TRL),
            ``"dr_grpo"`` (minus the group mean only), ``"rloo"`` (leave-one-out baseline).
        advantage_std: the group std of ``"grpo"``: ``"unbiased"`` (Bessel, TRL and verl) or
            ``"population"`` (divide by the group size, as flow_grpo).
        filter_groups: DAPO's dynamic sampling: a group whose rewards (the reward functions' sum,
            before ``overlong_penalty``) are all equal is dropped before training (counted in
            ``rollout/filtered_groups``) and more prompts are launched until the step has its
            ``batch_size`` groups; replacements run under the step's weights, so the staleness
            bound holds (see :mod:`unirl_lightning.rollout.loop`).
        max_filter_launches_per_step: the most replacement requests (each one prompt batch) a
            step may launch; a step still short after that raises ``RuntimeError``.
        **kwargs: every :class:`~unirl_lightning.modules.causal_lm.CausalLMModule` argument
            (``policy``, ``reward``, ``lora``, ``num_generations``, sampling, AdamW, ``loss``,
            clipping and ``clip_ratio_c``, ``ratio_level`` (``"sequence"``: GSPO), ``cispo_cap``,
            ``loss_aggregation``, KL, ``entropy_coef``, ``old_logprob``/``tis_cap``/
            ``sequence_mask_cap``, ``mask_truncated``, ``overlong_buffer``/``overlong_penalty``
            (added to the rewards before the advantages), ``ppo_epochs``/``mini_batches``,
            ``max_grad_norm``, ``micro_batch_tokens``/``micro_batch_rows`` (gradient accumulation
            inside each optimizer step), ``gradient_checkpointing``).

    Serving (HF, vLLM, SGLang; workers; weight sync) is the strategy's:
    ``AsyncRolloutStrategy(engine="vllm")`` serves the same module with vLLM.

    Example::

        module = GRPOModule(policy=TinyCausalLM(), reward=ExactMatchReward(), num_generations=8,
                            max_new_tokens=2, lr=7.5e-4)
    """

    def __init__(
        self,
        advantage: Advantage = "grpo",
        advantage_std: GroupStd = "unbiased",
        filter_groups: bool = False,
        max_filter_launches_per_step: int = 10,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.advantage = require_choice("advantage", advantage, Advantage)
        self.advantage_std = require_choice("advantage_std", advantage_std, GroupStd)
        if not isinstance(filter_groups, bool):
            raise ValueError(f"filter_groups must be true or false, got {filter_groups!r}")
        self.filter_groups = filter_groups
        self.max_filter_launches_per_step = require_at_least(
            "max_filter_launches_per_step", max_filter_launches_per_step, 1
        )
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations must be >= 2 for advantage={advantage!r} (it compares the samples of a "
                f"group), got {self.num_generations}"
            )

    def rollout_spec(self) -> RolloutSpec:
        return replace(
            super().rollout_spec(),
            filter_groups=self.filter_groups,
            max_filter_launches_per_step=self.max_filter_launches_per_step,
        )

    def compute_advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        if self.advantage == "rloo":
            return rloo_advantages(rewards, group_size)
        if self.advantage == "dr_grpo":
            return group_advantages(rewards, group_size, normalize="mean")
        return group_advantages(rewards, group_size, normalize="std", std=self.advantage_std)

    def prepare_batch(self, batch: ExperienceBatch) -> TokenContext:
        context = super().prepare_batch(batch)
        context.advantages = self.compute_advantages(self.sequence_rewards(batch), batch.group_size)
        return context

    def minibatch_loss(
        self, minibatch: ExperienceBatch, context: TokenContext
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.policy_loss(minibatch, context)
