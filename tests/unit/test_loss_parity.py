"""Loss parity: unirl_lightning.algorithms against the reference formulas of TRL, verl and flow_grpo.

The references are re-stated here from their sources (TRL ``GRPOTrainer._compute_loss`` and
``_generate_and_score_completions``, verl ``compute_policy_loss_vanilla`` and the DAPO reward
manager, flow_grpo ``PerPromptStatTracker``), on random batches with padding and an empty row;
the hand-computed tests in the per-module files pin the same numbers.
"""

import math
from typing import get_args

import pytest
import torch

from unirl_lightning.algorithms import (
    GROUP_NORMALIZATIONS,
    GROUP_STDS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    RATIO_LEVELS,
    GroupNormalization,
    GroupStd,
    KLEstimator,
    LossAggregation,
    PolicyLoss,
    RatioLevel,
    cispo_loss,
    clipped_value_loss,
    group_advantages,
    kl_penalty,
    overlong_penalty,
    ppo_clip_loss,
    sequence_masked_importance_weights,
)

# TRL loss_type -> our aggregation
TRL_LOSS_TYPES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm"}


def trl_grpo_loss(
    logp,
    old_logp,
    ref_logp,
    advantages,
    mask,
    is_ratio,
    beta,
    eps_low,
    eps_high,
    loss_type,
    L,
    importance_sampling_level="token",
):
    """TRL's order: clipped surrogate (or CISPO) -> x vLLM IS ratio -> + beta * k3 -> masked aggregation."""
    log_ratio = logp - old_logp
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:  # "sequence" (GSPO)
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    per_token_kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    advantages = advantages.unsqueeze(1)
    if loss_type == "cispo":  # epsilon_high is the cap itself under cispo
        clamped_ratios = torch.clamp(coef_1, max=eps_high).detach()
        per_token_loss = -clamped_ratios * advantages * logp
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    per_token_loss = per_token_loss * is_ratio
    per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "cispo"):  # cispo: / num_items_in_batch, the token count on one process
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    return (per_token_loss * mask).sum() / (per_token_loss.size(0) * L)  # dr_grpo


def random_batch(seed, spread=0.3):
    """Log-probs around a behaviour policy, a reference, advantages and IS ratios, with right padding
    and one row without a completion token."""
    generator = torch.Generator().manual_seed(seed)
    batch, width = 6, 5
    old_logp = -torch.rand(batch, width, generator=generator) * 3
    logp = (old_logp + spread * torch.randn(batch, width, generator=generator)).requires_grad_(True)
    ref_logp = old_logp + 0.3 * torch.randn(batch, width, generator=generator)
    advantages = torch.randn(batch, generator=generator)
    is_ratio = torch.rand(batch, width, generator=generator) * 2
    lengths = torch.tensor([5, 3, 1, 0, 4, 2])
    mask = (torch.arange(width) < lengths[:, None]).float()
    return logp, old_logp, ref_logp, advantages, is_ratio, mask


@pytest.mark.parametrize("loss_type", sorted(TRL_LOSS_TYPES))
def test_ppo_clip_loss_with_kl_and_is_weights_matches_trls_compute_loss_in_value_and_gradient(loss_type):
    generator = torch.Generator().manual_seed(0)
    batch, width, max_completion_length = 6, 5, 8
    old_logp = -torch.rand(batch, width, generator=generator) * 3
    logp = (old_logp + 0.3 * torch.randn(batch, width, generator=generator)).requires_grad_(True)
    ref_logp = old_logp + 0.3 * torch.randn(batch, width, generator=generator)
    advantages = torch.randn(batch, generator=generator)
    is_ratio = torch.rand(batch, width, generator=generator) * 2
    lengths = torch.tensor([5, 3, 1, 0, 4, 2])  # right padding and one row with no completion token
    mask = (torch.arange(width) < lengths[:, None]).float()
    beta, eps_low, eps_high = 0.04, 0.2, 0.28

    expected = trl_grpo_loss(
        logp,
        old_logp,
        ref_logp,
        advantages,
        mask,
        is_ratio,
        beta,
        eps_low,
        eps_high,
        loss_type,
        max_completion_length,
    )
    (expected_grad,) = torch.autograd.grad(expected, logp)
    loss, _ = ppo_clip_loss(
        logp,
        old_logp,
        advantages,
        mask,
        eps_low,
        eps_high,
        TRL_LOSS_TYPES[loss_type],
        is_ratio,
        max_tokens=max_completion_length,
        token_penalty=beta * kl_penalty(logp, ref_logp, "k3", mask=mask),
    )
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(loss, expected, rtol=1e-6, atol=1e-7)
    assert torch.allclose(grad, expected_grad, rtol=1e-6, atol=1e-8)


def test_group_advantages_match_trls_bessel_std_and_flow_grpos_population_std_both_with_eps_1e_minus_4():
    generator = torch.Generator().manual_seed(1)
    rewards = torch.rand(3 * 4, generator=generator)
    grouped = rewards.view(3, 4)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    # TRL nanstd: sqrt(mean sq dev * n / (n - 1)); flow_grpo: np.std (ddof 0); both + 1e-4
    trl = centred / (torch.sqrt((centred**2).mean(dim=1, keepdim=True) * 4 / 3) + 1e-4)
    flow_grpo = centred / (torch.sqrt((centred**2).mean(dim=1, keepdim=True)) + 1e-4)
    assert torch.allclose(group_advantages(rewards, 4), trl.reshape(-1))
    assert torch.allclose(group_advantages(rewards, 4, std="population"), flow_grpo.reshape(-1))


def test_clipped_value_loss_hands_max_tokens_to_the_dr_grpo_aggregation():
    values, returns = torch.tensor([[1.0, 3.0, 0.0]]), torch.zeros(1, 3)
    mask = torch.tensor([[1, 1, 0]])
    # 0.5 * (1 + 9) / max_tokens 4
    loss, _ = clipped_value_loss(values, values, returns, mask, None, "seq-mean-token-sum-norm", max_tokens=4)
    assert loss == 1.25
    with pytest.raises(ValueError, match=r"needs max_tokens.*got None"):
        clipped_value_loss(values, values, returns, mask, 0.5, "seq-mean-token-sum-norm")


@pytest.mark.parametrize("loss_type", sorted(TRL_LOSS_TYPES))
def test_sequence_ratio_matches_trls_importance_sampling_level_sequence_with_kl_and_is_weights(loss_type):
    logp, old_logp, ref_logp, advantages, is_ratio, mask = random_batch(2)
    beta, eps_low, eps_high, max_completion_length = 0.04, 3e-4, 4e-4, 8
    expected = trl_grpo_loss(
        logp, old_logp, ref_logp, advantages, mask, is_ratio, beta, eps_low, eps_high, loss_type,
        max_completion_length, importance_sampling_level="sequence",
    )  # fmt: skip
    (expected_grad,) = torch.autograd.grad(expected, logp)
    loss, metrics = ppo_clip_loss(
        logp,
        old_logp,
        advantages,
        mask,
        eps_low,
        eps_high,
        TRL_LOSS_TYPES[loss_type],
        is_ratio,
        max_tokens=max_completion_length,
        token_penalty=beta * kl_penalty(logp, ref_logp, "k3", mask=mask),
        ratio_level="sequence",
    )
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(loss, expected, rtol=1e-6, atol=1e-7)
    assert torch.allclose(grad, expected_grad, rtol=1e-5, atol=1e-8)
    assert 0 < metrics["clip_fraction"] < 1  # both branches of the clip are exercised


def test_cispo_matches_trls_loss_type_cispo_in_value_and_gradient():
    logp, old_logp, ref_logp, advantages, is_ratio, mask = random_batch(3, spread=0.5)
    beta, cap = 0.04, 1.2
    expected = trl_grpo_loss(logp, old_logp, ref_logp, advantages, mask, is_ratio, beta, 0.2, cap, "cispo", 8)
    (expected_grad,) = torch.autograd.grad(expected, logp)
    loss, metrics = cispo_loss(
        logp,
        old_logp,
        advantages,
        mask,
        cap,
        "token-mean",
        is_ratio,
        token_penalty=beta * kl_penalty(logp, ref_logp, "k3", mask=mask),
    )
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(loss, expected, rtol=1e-6, atol=1e-7)
    assert torch.allclose(grad, expected_grad, rtol=1e-6, atol=1e-8)
    assert 0 < metrics["clip_fraction"] < 1  # some weights are truncated, some not


def verl_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, low, high, clip_ratio_c):
    """verl ``compute_policy_loss_vanilla`` (``verl/trainer/ppo/core_algos.py``), ``loss_agg_mode="token-mean"``."""

    def masked_mean(x, mask):
        return (x * mask).sum() / mask.sum()

    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask
    )
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return masked_mean(pg_losses, response_mask), pg_clipfrac, pg_clipfrac_lower


def test_dual_clip_and_the_log_ratio_clamp_match_verls_compute_policy_loss():
    generator = torch.Generator().manual_seed(4)
    old_logp = -torch.rand(8, 6, generator=generator) * 3
    log_ratio = 1.5 * torch.randn(8, 6, generator=generator)  # ratios well above c = 3 ...
    log_ratio[0, 0], log_ratio[1, 1] = 40.0, -40.0  # ... and beyond the clamp
    logp = (old_logp + log_ratio).requires_grad_(True)
    advantages = torch.randn(8, 1, generator=generator).expand(8, 6)  # verl's token-level advantages
    mask = (torch.arange(6) < torch.tensor([6, 5, 3, 6, 1, 4, 2, 6])[:, None]).float()

    expected, clipfrac, clipfrac_lower = verl_policy_loss_vanilla(
        old_logp, logp, advantages, mask, 0.2, 0.28, 3.0
    )
    (expected_grad,) = torch.autograd.grad(expected, logp)
    loss, metrics = ppo_clip_loss(logp, old_logp, advantages, mask, 0.2, 0.28, clip_ratio_c=3.0)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(loss, expected, rtol=1e-6)
    assert torch.allclose(grad, expected_grad, rtol=1e-6, atol=1e-8)
    assert torch.allclose(metrics["clip_fraction"], clipfrac)
    assert torch.allclose(metrics["dual_clip_fraction"], clipfrac_lower) and clipfrac_lower > 0


def trl_sequence_mask_ratio(old_per_token_logps, sampling_per_token_logps, mask, clip_min, clip_max):
    """TRL ``GRPOTrainer._generate_and_score_completions`` (``trl/trainer/grpo_trainer.py``) with
    ``vllm_importance_sampling_mode="sequence_mask"``: ``per_sequence_logps_diff =
    per_token_logps_diff.sum(dim=-1, keepdim=True)``, ``exp``, ``masked_fill(invalid_mis_mask, 0.0)``;
    the ``[B, 1]`` ``importance_sampling_ratio`` multiplied into the per-token loss."""
    per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask
    per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    vllm_importance_sampling_ratio = torch.exp(per_sequence_logps_diff)
    invalid_mis_mask = (vllm_importance_sampling_ratio < clip_min) | (
        vllm_importance_sampling_ratio > clip_max
    )
    return vllm_importance_sampling_ratio.masked_fill(invalid_mis_mask, value=0.0)


def test_sequence_masked_importance_weights_match_trls_sequence_mask_and_compose_into_the_loss():
    logp, trainer_logp, ref_logp, advantages, _, mask = random_batch(5)
    generator = torch.Generator().manual_seed(6)
    rollout_logp = trainer_logp + 0.4 * torch.randn(trainer_logp.shape, generator=generator)
    cap = 2.0
    expected = trl_sequence_mask_ratio(trainer_logp, rollout_logp, mask, 1 / cap, cap)
    weights, rejected = sequence_masked_importance_weights(trainer_logp, rollout_logp, mask, cap)
    assert torch.allclose(weights, expected * mask)
    has_tokens = mask.bool().any(dim=-1)
    assert torch.equal(rejected, (expected.squeeze(-1) == 0) & has_tokens)
    assert 0 < rejected.sum() < has_tokens.sum()  # some sequences masked, some kept

    beta, eps = 0.04, 0.2
    reference = trl_grpo_loss(
        logp, trainer_logp, ref_logp, advantages, mask, expected, beta, eps, eps, "grpo", 8
    )
    loss, _ = ppo_clip_loss(
        logp,
        trainer_logp,
        advantages,
        mask,
        eps,
        eps,
        "seq-mean-token-mean",
        weights,
        token_penalty=beta * kl_penalty(logp, ref_logp, "k3", mask=mask),
    )
    assert torch.allclose(loss, reference, rtol=1e-6, atol=1e-7)


def verl_overlong_reward(valid_response_length, max_resp_len, overlong_buffer_len, overlong_penalty_factor):
    """verl ``DAPORewardManager`` (``verl/workers/reward_manager/dapo.py``), with the buffer enabled."""
    expected_len = max_resp_len - overlong_buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)


@pytest.mark.parametrize(("max_tokens", "buffer", "factor"), [(16, 4, 1.0), (10, 10, 0.5), (8, 1, 2.0)])
def test_overlong_penalty_matches_verls_dapo_reward_manager(max_tokens, buffer, factor):
    lengths = torch.arange(max_tokens + 1)
    expected = torch.tensor([verl_overlong_reward(int(n), max_tokens, buffer, factor) for n in lengths])
    assert torch.allclose(overlong_penalty(lengths, max_tokens, buffer, factor), expected.float())
    assert math.isclose(float(overlong_penalty(lengths, max_tokens, buffer, factor)[-1]), -factor)


@pytest.mark.parametrize(
    ("choices", "alias"),
    [
        (LOSS_AGGREGATIONS, LossAggregation),
        (POLICY_LOSSES, PolicyLoss),
        (RATIO_LEVELS, RatioLevel),
        (GROUP_NORMALIZATIONS, GroupNormalization),
        (GROUP_STDS, GroupStd),
        (KL_ESTIMATORS, KLEstimator),
    ],
)
def test_every_choice_tuple_is_the_values_of_its_literal_alias(choices, alias):
    assert choices == get_args(alias) and len(choices) > 1
