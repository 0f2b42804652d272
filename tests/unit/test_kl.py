"""Pins unirl_lightning.algorithms.kl against hand-computed numbers."""

import math

import pytest
import torch

from unirl_lightning.algorithms.kl import kl_penalty

# policy gives the token probability 1/2, the reference 1/4: log ratio = log 2
LOGP = torch.tensor([math.log(0.5)])
REF_LOGP = torch.tensor([math.log(0.25)])


def test_k1_is_the_log_ratio():
    assert torch.allclose(kl_penalty(LOGP, REF_LOGP, "k1"), torch.tensor([0.6931472]))


def test_k2_is_half_the_squared_log_ratio():
    assert torch.allclose(kl_penalty(LOGP, REF_LOGP, "k2"), torch.tensor([0.2402265]))  # 0.5 * log(2)^2


def test_k3_is_ratio_minus_one_minus_log_ratio_schulman_2020():
    # r = ref / pi = 1/2: r - 1 - log r = -0.5 + log 2
    assert torch.allclose(kl_penalty(LOGP, REF_LOGP), torch.tensor([0.1931472]))


def test_k3_is_zero_on_equal_policies_and_non_negative_otherwise():
    logp = torch.tensor([[-0.1, -2.0, -5.0]])
    assert torch.equal(kl_penalty(logp, logp.clone()), torch.zeros(1, 3))
    assert (kl_penalty(logp, torch.tensor([[-3.0, -0.2, -5.5]])) >= 0).all()


def test_k3_gradient_flows_to_logp():
    logp = LOGP.clone().requires_grad_(True)
    kl_penalty(logp, REF_LOGP).sum().backward()
    # d/d logp [exp(ref - logp) + logp - ref - 1] = 1 - r = 1 - 1/2
    assert torch.allclose(logp.grad, torch.tensor([0.5]))


def test_masked_tokens_give_exactly_zero_and_zero_gradient_even_with_garbage_log_probs():
    logp = torch.tensor([[math.log(0.5), -1e4, float("nan")]], requires_grad=True)
    ref_logp = torch.tensor([[math.log(0.25), 0.0, 0.0]])
    mask = torch.tensor([[1, 0, 0]])
    kl = kl_penalty(logp, ref_logp, mask=mask)  # exp(1e4) would be inf without the mask
    assert torch.allclose(kl, torch.tensor([[0.1931472, 0.0, 0.0]]))
    kl.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.5, 0.0, 0.0]]))  # not nan


def test_kl_penalty_rejects_unknown_estimator_and_shape_mismatch():
    with pytest.raises(ValueError, match=r"estimator must be one of \('k1', 'k2', 'k3'\), got 'k4'"):
        kl_penalty(LOGP, REF_LOGP, "k4")
    with pytest.raises(ValueError, match=r"ref_logp must have the shape of logp \(1,\), got \(2,\)"):
        kl_penalty(LOGP, torch.zeros(2))
    with pytest.raises(ValueError, match=r"mask must have the shape of logp \(1,\), got \(2,\)"):
        kl_penalty(LOGP, REF_LOGP, mask=torch.ones(2))
