"""Pins unirl_lightning.algorithms.correction against hand-computed numbers."""

import math

import pytest
import torch

from unirl_lightning.algorithms.correction import truncated_importance_weights


def test_weights_are_the_ratio_truncated_at_cap_and_zero_on_masked_tokens():
    rollout_logp = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    # ratios 1.5, 3.0 (capped to 2), 0.25, and a masked token with an overflowing ratio
    trainer_logp = rollout_logp + torch.tensor([[math.log(1.5), math.log(3.0), math.log(0.25), 1e4]])
    mask = torch.tensor([[1, 1, 1, 0]])
    weights = truncated_importance_weights(trainer_logp, rollout_logp, mask, cap=2.0)
    assert torch.allclose(weights, torch.tensor([[1.5, 2.0, 0.25, 0.0]]))


def test_weights_are_one_when_rollout_and_trainer_agree():
    logp = torch.tensor([[-0.5, -2.0]])
    assert torch.equal(truncated_importance_weights(logp, logp.clone(), torch.ones(1, 2)), torch.ones(1, 2))


def test_weights_are_detached():
    trainer_logp = torch.zeros(1, 2, requires_grad=True)
    weights = truncated_importance_weights(trainer_logp, torch.zeros(1, 2), torch.ones(1, 2))
    assert not weights.requires_grad


def test_rejects_non_positive_cap_and_shape_mismatch():
    with pytest.raises(ValueError, match=r"cap must be > 0, got 0.0"):
        truncated_importance_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), cap=0.0)
    with pytest.raises(ValueError, match=r"same shape, got trainer_logp=\(1, 2\), rollout_logp=\(1, 3\)"):
        truncated_importance_weights(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))
