"""Loss parity: unirl_lightning.algorithms against the reference formulas of TRL and flow_grpo.

The references are re-stated here from their sources (TRL ``GRPOTrainer._compute_loss`` and
``_generate_and_score_completions``, flow_grpo ``PerPromptStatTracker``), on random batches with
padding and an empty row; the hand-computed tests in the per-module files pin the same numbers.
"""

from typing import get_args

import pytest
import torch

from unirl_lightning.algorithms import (
    GROUP_NORMALIZATIONS,
    GROUP_STDS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    GroupNormalization,
    GroupStd,
    KLEstimator,
    LossAggregation,
    clipped_value_loss,
    group_advantages,
    kl_penalty,
    ppo_clip_loss,
)

# TRL loss_type -> our aggregation
TRL_LOSS_TYPES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm"}


def trl_grpo_loss(
    logp, old_logp, ref_logp, advantages, mask, is_ratio, beta, eps_low, eps_high, loss_type, L
):
    """TRL's order: clipped surrogate -> x vLLM IS ratio -> + beta * k3 -> masked aggregation."""
    coef_1 = torch.exp(logp - old_logp)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    advantages = advantages.unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    per_token_loss = per_token_loss * is_ratio
    per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    return (per_token_loss * mask).sum() / (per_token_loss.size(0) * L)  # dr_grpo


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


@pytest.mark.parametrize(
    ("choices", "alias"),
    [
        (LOSS_AGGREGATIONS, LossAggregation),
        (GROUP_NORMALIZATIONS, GroupNormalization),
        (GROUP_STDS, GroupStd),
        (KL_ESTIMATORS, KLEstimator),
    ],
)
def test_every_choice_tuple_is_the_values_of_its_literal_alias(choices, alias):
    assert choices == get_args(alias) and len(choices) > 1
