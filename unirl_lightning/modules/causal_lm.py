"""CausalLMModule: what GRPO and PPO on a causal LM share, on the policy-gradient base.

The policy (built from its spec, optionally wrapped in LoRA adapters), the sampling, the trainer's
log-probs of the sampled tokens at the sampling temperature, the reference log-probs for a KL
term, and the policy loss (PPO-clip per token or per sequence, or CISPO; KL, entropy bonus,
overlong handling) with its off-policy handling:

* ``old_logprob="rollout"`` (default): the PPO ratio is taken against the behaviour log-probs the
  engine recorded, so clipping bounds the update relative to the policy that actually generated
  the data, stale or not.
* ``old_logprob="recompute"``: the ratio is taken against the trainer's own log-probs before the
  update (decoupled PPO) and, with ``tis_cap``, every token is reweighted by the truncated
  importance weight ``min(pi_trainer / pi_rollout, tis_cap)``; or, with ``sequence_mask_cap``,
  every sequence by its ratio ``pi_trainer / pi_rollout`` over the whole sequence, and dropped
  when that leaves ``[1 / cap, cap]`` (sequence-level masked importance sampling).

Subclasses (:class:`~unirl_lightning.modules.grpo.GRPOModule`,
:class:`~unirl_lightning.modules.ppo.PPOModule`) add their advantages.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from unirl_lightning.algorithms import (
    LossAggregation,
    PolicyLoss,
    RatioLevel,
    kl_penalty,
    masked_mean,
    overlong_penalty,
    truncated_completions,
)
from unirl_lightning.algorithms.kl import KLEstimator
from unirl_lightning.core.checks import require_at_least, require_in_range
from unirl_lightning.core.preflight import chat_template_warning
from unirl_lightning.distributed.meta_init import (
    fill_from_rank0,
    full_states,
    launched_as_local_rank_above_zero,
    ranks_to_fill,
)
from unirl_lightning.distributed.sharding import shard_children
from unirl_lightning.models.causal_lm import PretrainedCausalLM, TinyCausalLM
from unirl_lightning.models.lora import LLM_LORA_TARGETS, LoraSpec, apply_lora
from unirl_lightning.modules.base import PolicyGradientModule
from unirl_lightning.modules.context import TokenContext
from unirl_lightning.modules.loss_settings import MismatchCorrection, OldLogprob, PolicyLossSettings
from unirl_lightning.modules.microbatch import MicroBatcher
from unirl_lightning.modules.optim import LOW_PRECISION_DTYPES
from unirl_lightning.modules.schedule import LRSchedule
from unirl_lightning.modules.spec import RolloutSpec
from unirl_lightning.modules.tokens import (
    SEQUENCE_UNIT_METRICS,
    enable_gradient_checkpointing,
    sequence_logprobs,
)
from unirl_lightning.rewards import ExactMatchReward, Reward, resolve_reward
from unirl_lightning.rollout.batches import ExperienceBatch
from unirl_lightning.rollout.records import SamplingParams

__all__ = ["CausalLMModule", "OldLogprob"]


class CausalLMModule(PolicyGradientModule):
    """A causal-LM policy trained with a PPO-clip or CISPO loss (see the module docstring).

    Args:
        policy: what to train; also what every rollout engine builds before weights are pushed.
        reward: a reward object (``unirl_lightning.rewards``) or an import path ``"pkg.mod:func"`` of a
            per-sample callable ``func(completion, record) -> float``; default: exact match.
        lora: train ``peft`` LoRA adapters instead of all weights; only adapters are pushed.
        num_generations: completions per prompt (the group size).
        temperature: sampling temperature, ``> 0``; the trainer's log-probs are taken at it too.
        top_p: nucleus sampling; 1.0 = off.
        max_new_tokens: the completion budget; plus the longest prompt it must fit the policy's positions.
        top_k: top-k truncation; 0 = off. Every engine applies it (see
            :class:`~unirl_lightning.rollout.records.SamplingParams` for the log-probs under truncation).
        min_p: min-p truncation; 0.0 = off.
        repetition_penalty: CTRL's repetition penalty; 1.0 = off.
        stop: stop strings; none by default.
        lr: AdamW's learning rate.
        weight_decay: AdamW's decoupled weight decay.
        betas: AdamW's ``(beta1, beta2)``.
        lr_schedule: ``"constant"``, ``"linear"`` or ``"cosine"`` decay of the learning rate to 0 at
            ``trainer.max_steps`` (RL steps), stepped every optimizer step (Hugging Face's and
            TRL's schedules, :mod:`~unirl_lightning.modules.schedule`); logged as ``train/lr``.
        warmup_steps: RL steps of linear warmup from 0 to ``lr`` first (stepped every optimizer
            step); 0 = none.
        loss: ``"ppo"`` (clipped surrogate) or ``"cispo"`` (MiniMax-M1: ``-sg(min(r, cispo_cap)) * A *
            logp``, a gradient for every token; token level, without ``clip_ratio_c``; the clip
            range is unused).
        clip_low: the PPO clip range's lower side: ratios below ``1 - clip_low`` are clipped.
        clip_high: its upper side, ``1 + clip_high`` (clip-higher, DAPO: 0.28).
        clip_ratio_c: dual-clip (Ye et al. 2020, verl's ``clip_ratio_c``): the loss of a token with
            ``A < 0`` is at most ``-A * clip_ratio_c``, so a stale token with a huge ratio cannot
            dominate the update; ``> 1``, None = off. Only ratios above it change the loss. Defined for
            ``loss="ppo"`` at ``ratio_level="token"``: set it to None with ``"cispo"`` or ``"sequence"``.
        ratio_level: ``"token"`` (PPO) or ``"sequence"`` (GSPO, Zheng et al. 2025: the geometric mean of
            the sequence's token ratios, clipped per sequence; use its small clip range, e.g.
            ``clip_low=3e-4``, ``clip_high=4e-4``, with ``loss_aggregation="seq-mean-token-mean"`` as
            in the paper). Needs one advantage per sequence (not PPOModule's GAE).
        cispo_cap: the largest CISPO importance weight (TRL's ``epsilon_high`` under ``"cispo"``,
            ScaleRL's ``eps_max``; MiniMax-M1's ``1 + eps_high``), ``>= 1``; read only with ``"cispo"``.
        loss_aggregation: ``"token-mean"``, ``"seq-mean-token-mean"`` or ``"seq-mean-token-sum-norm"``.
            ``"token-mean"`` is the global token mean over the ranks (DAPO; TRL's ``"dapo"``): each
            mini-batch's token count is summed over the data-parallel ranks (one all-reduce) and every
            rank's loss is its token sum over that count times the world size, so that after the
            gradient averaging of DDP / FSDP2 the gradient is the one-rank gradient of the union of
            the ranks' rows. The ``seq-mean-*`` ones divide by the mini-batch's rows on each rank.
        kl_coef: weight of the per-token KL to a frozen copy of the initial policy; 0 = none kept.
        kl_estimator: the KL estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        entropy_coef: entropy bonus, ``loss -= entropy_coef * aggregated entropy`` (aggregated like the
            loss, verl's ``entropy_coeff``), ``>= 0``. Non-zero costs a pass over the vocabulary with
            gradient on every mini-batch; at 0 the entropy is only logged, without gradient.
        old_logprob: ``"rollout"`` or ``"recompute"`` (see the module docstring).
        tis_cap: truncated importance-sampling cap (``old_logprob="recompute"`` only); None = off.
        sequence_mask_cap: sequence-level masked importance sampling (TRL
            ``vllm_importance_sampling_mode="sequence_mask"``): each sequence is weighted by its ratio
            ``exp(sum_t (trainer_logp - rollout_logp))``, and left out of the loss when that leaves
            ``[1 / cap, cap]`` (logged as ``mismatch_masked_fraction``); ``> 1``, None = off.
            ``old_logprob="recompute"`` only, and not with ``tis_cap``.
        mask_truncated: leave the completions the token budget cut off out of the loss (DAPO's
            overlong filtering; their rewards still count in the group's advantages). A completion
            is truncated when it has ``max_new_tokens`` tokens and its last one is no stop token
            (EOS, end of turn).
        overlong_buffer: DAPO's soft overlong punishment, added to the reward before the advantages: 0
            up to ``max_new_tokens - overlong_buffer`` tokens, then falling linearly to
            ``-overlong_penalty`` at ``max_new_tokens``; in ``[0, max_new_tokens]``, 0 = off.
        overlong_penalty: the punishment at ``max_new_tokens``, ``>= 0``.
        ppo_epochs: passes over each rollout batch.
        mini_batches: optimizer steps per pass (the batch is cut into this many mini-batches).
        max_grad_norm: gradient clipping through Lightning (``clip_gradients``); 0 = off.
        micro_batch_tokens: split every forward and backward (the no-grad recompute of the old and
            reference log-probs, the loss, the critic) into micro-batches of rows whose padded size,
            ``rows x longest row``, stays within this many tokens (at least one row each; rows are
            packed longest first, and each micro-batch is cut to its longest row). Gradients
            accumulate into the mini-batch's one optimizer step; the loss, gradients and logged
            metrics are the whole mini-batch's. None = no token budget.
        micro_batch_rows: at most this many rows per micro-batch (alone, or with
            ``micro_batch_tokens``); None = no row limit.
        gradient_checkpointing: recompute every transformer block's activations in the backward
            instead of keeping them (``transformers``' ``gradient_checkpointing_enable`` with
            ``use_reentrant=False``, on the policy and on a critic's backbone); the gradients are
            the same. Composes with FSDP2 sharding (the blocks stay the modules that are sharded).
        load_once_per_node: in a multi-process launch only each node's first rank loads the weights:
            a rank whose launcher made it a node-local rank > 0 (``LOCAL_RANK`` or ``SLURM_LOCALID``)
            builds the policy (and a critic) on the meta device, from the config alone, and receives
            global rank 0's weights in ``configure_model``, on its training device (DDP: a broadcast
            of every parameter and buffer; FSDP2: each rank keeps its shard of rank 0's full state),
            so the host holds one copy of the model per node instead of one per rank
            (:mod:`unirl_lightning.distributed.meta_init`). False: every rank loads its own. A single process
            always loads. A launch setting, not a training one: not saved in the checkpoint's
            hyperparameters.
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
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        stop: list[str] | None = None,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        lr_schedule: LRSchedule = "constant",
        warmup_steps: int = 0,
        loss: PolicyLoss = "ppo",
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        clip_ratio_c: float | None = 3.0,
        ratio_level: RatioLevel = "token",
        cispo_cap: float = 5.0,
        loss_aggregation: LossAggregation = "token-mean",
        kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        entropy_coef: float = 0.0,
        old_logprob: OldLogprob = "rollout",
        tis_cap: float | None = None,
        sequence_mask_cap: float | None = None,
        mask_truncated: bool = False,
        overlong_buffer: int = 0,
        overlong_penalty: float = 1.0,
        ppo_epochs: int = 1,
        mini_batches: int = 1,
        max_grad_norm: float = 1.0,
        micro_batch_tokens: int | None = None,
        micro_batch_rows: int | None = None,
        gradient_checkpointing: bool = False,
        load_once_per_node: bool = True,
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
            micro_batcher=MicroBatcher(micro_batch_rows, micro_batch_tokens, token_rows=True),
        )
        self.gradient_checkpointing = bool(gradient_checkpointing)
        require_at_least("num_generations", num_generations, 1)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 for training rollouts, got {temperature!r}")
        self.loss_settings = PolicyLossSettings(
            loss=loss,
            clip_low=clip_low,
            clip_high=clip_high,
            clip_ratio_c=clip_ratio_c,
            ratio_level=ratio_level,
            cispo_cap=cispo_cap,
            loss_aggregation=loss_aggregation,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
        )
        self.correction = MismatchCorrection(old_logprob, tis_cap, sequence_mask_cap)
        require_in_range("overlong_buffer", overlong_buffer, 0, max_new_tokens)
        require_at_least("overlong_penalty", overlong_penalty, 0)
        self.save_hyperparameters(ignore=["policy", "reward", "lora", "load_once_per_node"])
        self.load_once_per_node = bool(load_once_per_node)
        # a node-local rank > 0 builds its networks without values; configure_model fills them from rank 0
        self.built_on_meta = self.load_once_per_node and launched_as_local_rank_above_zero()
        self.policy_spec = policy or TinyCausalLM()
        self.policy, self.tokenizer = self.build_policy()
        self.lora = lora.resolved() if lora is not None else None  # its init seed travels to the engines
        if self.lora is not None:  # only the adapters train, and only they are pushed to the engines
            self.policy = apply_lora(self.policy, self.lora, LLM_LORA_TARGETS)
        if self.gradient_checkpointing:
            enable_gradient_checkpointing(self.policy)
        chat_warning = chat_template_warning(
            bool(getattr(self.policy_spec, "chat", False)),
            bool(getattr(self.tokenizer, "chat_template", None)),
            str(getattr(self.policy_spec, "name_or_path", type(self.policy_spec).__name__)),
        )
        if chat_warning is not None:
            rank_zero_warn(chat_warning)
        self.reward = resolve_reward(reward) if reward is not None else ExactMatchReward()
        self.sampling = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            stop=tuple(stop or ()),
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
        )
        positions = getattr(getattr(self.policy, "config", None), "max_position_embeddings", None)
        if isinstance(positions, int) and max_new_tokens >= positions:  # a prompt takes at least one
            raise ValueError(
                f"max_new_tokens={max_new_tokens} does not fit the policy's max_position_embeddings={positions} "
                "(the prompt needs positions too): lower max_new_tokens"
            )
        self.num_generations = num_generations
        self.mask_truncated = mask_truncated
        self.overlong_buffer, self.overlong_penalty = overlong_buffer, overlong_penalty
        # what ends a completion: a full-budget completion without one of these was cut off
        self.stop_ids = tuple(self.policy_spec.stop_ids(self.tokenizer)) if mask_truncated else ()

    # -- what the strategy needs ----------------------------------------------------------------
    def prompt_length(self, record: dict[str, Any]) -> int:
        """The number of prompt tokens ``record`` renders to, as every engine renders it (the chat
        template and system prompt included): what ``PromptDataModule(max_prompt_length)`` reads."""
        return len(self.policy_spec.prompt_ids(self.tokenizer, record))

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

    def build_policy(self) -> tuple[torch.nn.Module, Any]:
        """``(model, tokenizer)`` from the policy spec: with its weights, or on the meta device where
        :attr:`built_on_meta` (the weights come from rank 0 in :meth:`configure_model`)."""
        return self.policy_spec.build_on_meta() if self.built_on_meta else self.policy_spec.build()

    def configure_model(self) -> None:
        """Under a sharding strategy (``AsyncRolloutFSDPStrategy``: Lightning gives the module a
        device mesh) every network of the module is sharded with FSDP2, one shard group per
        transformer block. With ``load_once_per_node``, when some rank built its networks on the meta
        device, every rank then gets global rank 0's parameters and buffers on its training device
        (:func:`~unirl_lightning.distributed.meta_init.fill_from_rank0`; under FSDP2 rank 0's full state is taken
        before sharding and each rank keeps its shard). Lightning calls this after :meth:`setup`, so
        the KL reference and the float32 masters are filled too, and before the strategy wraps the
        module or pushes weights. Idempotent: a second call finds nothing on the meta device."""
        mesh = self.device_mesh
        fill = self.load_once_per_node and ranks_to_fill(self, "load_once_per_node")
        states = full_states(self) if fill and mesh is not None else None
        if mesh is not None:
            shard_children(self, mesh)
        if fill:
            trainer = self.attached_trainer()
            device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
            fill_from_rank0(self, device, states)

    @property
    def compute_dtype(self) -> torch.dtype | None:  # type: ignore[override]
        """The policy spec's dtype when it is bf16/fp16: the forwards run in it under autocast, over
        float32 masters of the trainable weights (the frozen reference and LoRA base weights stay in
        it); None for a float32 policy (see :class:`~unirl_lightning.modules.base.PolicyGradientModule`)."""
        dtype = getattr(torch, getattr(self.policy_spec, "dtype", "float32"))
        return dtype if dtype in LOW_PRECISION_DTYPES else None

    def eval_sampling(self, temperature: float) -> SamplingParams:
        return SamplingParams(
            temperature=temperature, max_new_tokens=self.sampling.max_new_tokens, stop=self.sampling.stop
        )

    # -- log-probs ------------------------------------------------------------------------------
    def sequence_logprobs(
        self,
        model: torch.nn.Module,
        batch: ExperienceBatch,
        entropy: bool = False,
        entropy_grad: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``model``'s log-prob of every next token of ``batch``, ``[N, L-1]``, at the sampling
        temperature, its forward under :meth:`autocast` (with ``entropy=True`` also the entropy at every
        position, detached unless ``entropy_grad``; see
        :func:`~unirl_lightning.modules.tokens.sequence_logprobs`)."""
        return sequence_logprobs(
            model, batch, self.sampling.temperature, self.autocast, entropy=entropy, entropy_grad=entropy_grad
        )

    @torch.no_grad()
    def prepare_batch(self, batch: ExperienceBatch) -> TokenContext:
        """The trainer's log-probs before this step (``old_logprob="recompute"``), the reference's
        (with a KL term) and, with ``mask_truncated``, the rows the loss keeps; a subclass adds the
        ``advantages`` (from :meth:`sequence_rewards`). The forwards run a micro-batch at a time."""
        context = TokenContext()
        if self.correction.recompute:
            context.prox_logp = self.per_micro_batch(batch, lambda b: self.sequence_logprobs(self.policy, b))
        if self.kl_coef > 0:
            with self.reference_policy() as reference:
                context.ref_logp = self.per_micro_batch(batch, lambda b: self.sequence_logprobs(reference, b))
        if self.mask_truncated:
            context.trained_rows = ~self.truncated_rows(batch)
        return context

    # -- what the loss is a mean over -----------------------------------------------------------
    @property
    def global_loss_mean(self) -> bool:  # type: ignore[override]
        """``"token-mean"`` is the global token mean over the data-parallel ranks."""
        return self.loss_settings.token_mean

    def loss_units(self, batch: ExperienceBatch, context: TokenContext) -> torch.Tensor:
        """``"token-mean"``: the loss tokens of ``batch``; ``"seq-mean-*"``: its rows."""
        if self.loss_settings.token_mean:
            return self.loss_mask(batch, context).bool().sum().float()
        return super().loss_units(batch, context)

    def metric_weight(self, batch: ExperienceBatch, context: TokenContext, key: str) -> torch.Tensor:
        """Token metrics weigh by the loss tokens; the per-sequence ones (``mismatch_masked_fraction``,
        and the ratio and clip figures at ``ratio_level="sequence"``) by the rows with a loss token."""
        mask = self.loss_mask(batch, context).bool()
        if key == "mismatch_masked_fraction" or (
            self.loss_settings.ratio_level == "sequence" and key in SEQUENCE_UNIT_METRICS
        ):
            return mask.any(dim=-1).sum().float()
        return mask.sum().float()

    # -- overlong completions -------------------------------------------------------------------
    def truncated_rows(self, batch: ExperienceBatch) -> torch.Tensor:
        """``[N]`` bool: the completions the token budget cut off, read off the batch (it records no
        finish reason): ``max_new_tokens`` completion tokens and a last token that is no stop token
        (:func:`~unirl_lightning.algorithms.truncated_completions`)."""
        last_column = (batch.attention_mask.sum(dim=-1) - 1).clamp(min=0)  # rows are right-padded
        last_tokens = batch.input_ids.gather(1, last_column.unsqueeze(-1)).squeeze(-1)
        lengths = batch.response_mask.sum(dim=-1)
        return truncated_completions(last_tokens, lengths, self.sampling.max_new_tokens, self.stop_ids)

    def sequence_rewards(self, batch: ExperienceBatch) -> torch.Tensor:
        """``[N]`` the rewards the advantages are computed from: the batch's, plus DAPO's soft overlong
        penalty of each completion's length with ``overlong_buffer`` (its mean is logged as
        ``train/overlong_penalty_mean``)."""
        if self.overlong_buffer == 0:
            return batch.rewards
        penalty = overlong_penalty(
            batch.response_mask.sum(dim=-1),
            self.sampling.max_new_tokens,
            self.overlong_buffer,
            self.overlong_penalty,
        )
        batch.stats["train/overlong_penalty_mean"] = float(penalty.mean())
        return batch.rewards + penalty.to(batch.rewards.dtype)

    def loss_mask(self, minibatch: ExperienceBatch, context: TokenContext) -> torch.Tensor:
        """``[B, L-1]`` the tokens a loss is taken over: the trained completion tokens of the rows the
        context keeps (all rows unless ``mask_truncated``)."""
        mask = minibatch.response_mask[:, 1:]
        if context.trained_rows is not None:
            mask = mask * context.trained_rows.unsqueeze(-1)
        return mask

    # -- the loss -------------------------------------------------------------------------------
    def policy_loss(
        self, minibatch: ExperienceBatch, context: TokenContext
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Policy loss (+ ``kl_coef`` x per-token KL to the reference - ``entropy_coef`` x entropy) of
        one mini-batch, with its metrics.

        ``context.advantages`` are per row ``[B]`` or per token ``[B, L-1]``; ``prox_logp``,
        ``ref_logp`` and ``trained_rows`` are this mini-batch's rows, or None.
        """
        mask = self.loss_mask(minibatch, context)
        rollout_logp = minibatch.rollout_logprobs[:, 1:]
        prox_logp, ref_logp = context.prox_logp, context.ref_logp
        settings = self.loss_settings
        entropy = None
        if settings.entropy_coef > 0:  # the bonus: the entropy with its gradient, on every mini-batch
            logp, entropy = self.sequence_logprobs(self.policy, minibatch, entropy=True, entropy_grad=True)
        elif self.first_minibatch:  # the logged mini-batch: the entropy too (a pass over the vocabulary)
            logp, entropy = self.sequence_logprobs(self.policy, minibatch, entropy=True)
        else:
            logp = self.sequence_logprobs(self.policy, minibatch)
        old_logp = rollout_logp if prox_logp is None else prox_logp
        is_weights, mismatch_metrics = self.correction.weights(prox_logp, rollout_logp, mask)
        kl = None if ref_logp is None else kl_penalty(logp, ref_logp, settings.kl_estimator, mask=mask)
        # KL and entropy are added per token before aggregation (TRL, verl), so every aggregation
        # weighs them like the policy term
        token_penalty = None if kl is None else self.kl_coef * kl
        if settings.entropy_coef > 0:
            bonus = -settings.entropy_coef * entropy
            token_penalty = bonus if token_penalty is None else token_penalty + bonus
        loss, metrics = settings.surrogate(
            logp, old_logp, context.advantages, mask, is_weights, token_penalty, self.sampling.max_new_tokens
        )
        metrics.update(mismatch_metrics)
        metrics["logp_diff_abs"] = masked_mean((logp.detach() - rollout_logp).abs(), mask)
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy.detach(), mask)
        if kl is not None:
            metrics["kl"] = masked_mean(kl.detach(), mask)
        return loss, metrics
