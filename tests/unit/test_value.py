"""Value-function math against hand-computed numbers."""

from __future__ import annotations

import math

import torch

from unirl_lightning.algorithms import (
    clipped_value_loss,
    explained_variance,
    last_token_rewards,
    masked_whiten,
)


def test_each_sequence_reward_lands_on_its_last_valid_token():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    out = last_token_rewards(torch.tensor([1.0, 2.0]), mask)
    assert out.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]]


def test_whitening_uses_valid_tokens_only_and_zeroes_the_rest():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    out = masked_whiten(x, torch.tensor([[1, 1, 0]]))  # mean 2, variance 1 over the first two
    assert torch.allclose(out, torch.tensor([[-1.0, 1.0, 0.0]]), atol=1e-6)


def test_clipped_value_loss_takes_the_worse_of_clipped_and_unclipped():
    values, old, returns, mask = (
        torch.tensor([[2.0]]),
        torch.tensor([[0.0]]),
        torch.tensor([[3.0]]),
        torch.ones(1, 1),
    )
    # unclipped (2-3)^2 = 1; clipped V = 0 + clamp(2, +-0.5) = 0.5 -> (0.5-3)^2 = 6.25; 0.5 * max = 3.125
    loss, clip_fraction = clipped_value_loss(values, old, returns, mask, 0.5, "token-mean")
    assert loss.item() == 3.125 and clip_fraction.item() == 1.0
    loss, clip_fraction = clipped_value_loss(values, old, returns, mask, None, "token-mean")
    assert loss.item() == 0.5 and clip_fraction.item() == 0.0


def test_explained_variance_is_one_for_a_perfect_critic_zero_for_a_constant_nan_without_variance():
    mask = torch.ones(1, 2)
    returns = torch.tensor([[1.0, 3.0]])
    assert explained_variance(returns.clone(), returns, mask).item() == 1.0
    assert explained_variance(torch.zeros(1, 2), returns, mask).item() == 0.0
    assert math.isnan(explained_variance(torch.zeros(1, 2), torch.ones(1, 2), mask).item())
