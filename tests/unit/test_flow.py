"""Pins unirl_lightning.algorithms.flow (Flow-GRPO SDE step) against hand-computed numbers."""

import math

import pytest
import torch

from unirl_lightning.algorithms.flow import flow_grpo_kl, gaussian_log_prob, sde_std_dev_t, sde_step

HALF_LOG_2PI = 0.9189385332


def test_gaussian_log_prob_at_the_mean_is_minus_log_std_minus_half_log_2pi():
    assert torch.allclose(
        gaussian_log_prob(torch.tensor([3.0]), torch.tensor([3.0]), 1.0), torch.tensor([-HALF_LOG_2PI])
    )
    # x = mean + 2, std = 2: -4 / 8 - log 2 - 0.918939
    out = gaussian_log_prob(torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor(2.0))
    assert torch.allclose(out, torch.tensor([-0.5 - math.log(2.0) - HALF_LOG_2PI]))


def test_sde_step_mean_std_and_log_prob_match_hand_computation():
    # sigma 0.5 -> 0.25, eta 1: dt = -0.25, std_dev_t = sqrt(0.5 / 0.5) = 1
    # mean = 1 * (1 + 1 / 1 * -0.25) + 2 * (1 + 1 * 0.5 / 1) * -0.25 = 0.75 - 0.75 = 0
    # std = 1 * sqrt(0.25) = 0.5
    sample = torch.tensor([[1.0, 1.0]])
    velocity = torch.tensor([[2.0, 2.0]])
    prev = torch.tensor([[0.5, 0.0]])
    prev_sample, log_prob, mean, std = sde_step(velocity, sample, 0.5, 0.25, eta=1.0, prev_sample=prev)
    assert torch.allclose(mean, torch.zeros(1, 2))
    assert torch.allclose(std, torch.tensor(0.5))
    assert torch.equal(prev_sample, prev)
    # per element: -(0.5^2) / (2 * 0.25) + log 2 - 0.918939 = -0.725792 and log 2 - 0.918939 = -0.225792
    assert log_prob.shape == (1,)
    assert torch.allclose(log_prob, torch.tensor([-0.4757918]))


def test_sde_step_at_sigma_one_uses_sigma_next_in_the_std_formula():
    # sigma 1 -> 0.8, eta 0.5: std_dev_t = 0.5 * sqrt(1 / (1 - 0.8)) = 0.5 sqrt 5, std = that * sqrt(0.2) = 0.5
    # mean = x * (1 + 1.25 / 2 * -0.2) + v * (1 + 0) * -0.2 = 0.875 x - 0.2 v
    sample = torch.tensor([[2.0], [4.0]])
    velocity = torch.tensor([[1.0], [-1.0]])
    _, log_prob, mean, std = sde_step(velocity, sample, 1.0, 0.8, eta=0.5)
    assert torch.allclose(std, torch.tensor(0.5))
    assert torch.allclose(mean, torch.tensor([[1.55], [3.7]]))
    assert torch.isfinite(log_prob).all()


def test_sde_step_accepts_per_sample_sigmas():
    sample = torch.ones(2, 1, 2)
    velocity = torch.full((2, 1, 2), 2.0)
    _, _, mean, std = sde_step(velocity, sample, torch.tensor([0.5, 1.0]), torch.tensor([0.25, 0.8]), eta=1.0)
    assert std.shape == (2, 1, 1)
    # row 0 as in the hand-computed case (mean 0, std 0.5); row 1: std_dev_t = sqrt 5, std = 1,
    # mean = 1 * (1 + 5 / 2 * -0.2) + 2 * -0.2 = 0.5 - 0.4 = 0.1
    assert torch.allclose(std.flatten(), torch.tensor([0.5, 1.0]))
    assert torch.allclose(mean, torch.tensor([[[0.0, 0.0]], [[0.1, 0.1]]]))


def test_replaying_the_sampled_step_gives_bitwise_the_same_log_prob():
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(3, 4, 5, generator=generator)
    velocity = torch.randn(3, 4, 5, generator=generator)
    prev_sample, log_prob, mean, _ = sde_step(velocity, sample, 0.7, 0.6, eta=0.7, generator=generator)
    replayed, replayed_log_prob, replayed_mean, _ = sde_step(
        velocity, sample, 0.7, 0.6, eta=0.7, prev_sample=prev_sample
    )
    assert torch.equal(replayed, prev_sample)
    assert torch.equal(replayed_mean, mean)
    assert torch.equal(replayed_log_prob, log_prob)  # on-policy PPO ratio is exactly 1


def test_generator_makes_the_noise_reproducible():
    sample, velocity = torch.zeros(1, 3), torch.zeros(1, 3)
    first = sde_step(velocity, sample, 0.5, 0.25, eta=1.0, generator=torch.Generator().manual_seed(7))[0]
    second = sde_step(velocity, sample, 0.5, 0.25, eta=1.0, generator=torch.Generator().manual_seed(7))[0]
    assert torch.equal(first, second)


def test_eta_zero_is_the_deterministic_euler_step_with_zero_log_prob():
    sample = torch.tensor([[1.0, -2.0]])
    velocity = torch.tensor([[4.0, 2.0]])
    prev_sample, log_prob, mean, std = sde_step(velocity, sample, 0.5, 0.25, eta=0.0)
    # sample + v * dt with dt = -0.25
    assert torch.equal(prev_sample, torch.tensor([[0.0, -2.5]]))
    assert torch.equal(mean, prev_sample)
    assert torch.equal(log_prob, torch.zeros(1))
    assert std == 0.0


def test_gradient_flows_through_the_mean_to_the_model_output_only():
    velocity = torch.zeros(1, 2, requires_grad=True)
    prev = torch.tensor([[0.5, 0.0]], requires_grad=True)
    _, log_prob, _, _ = sde_step(velocity, torch.ones(1, 2), 0.5, 0.25, eta=1.0, prev_sample=prev)
    log_prob.sum().backward()
    # mean = 0.75 + 1.5 * -0.25 * v; d log_prob / d mean_i = (x_i - mean_i) / std^2 / 2 elements
    # at v = 0: mean = 0.75, (x - mean) / 0.25 = [-1, -3]; times dmean/dv = -0.375, over 2 -> [0.1875, 0.5625]
    assert torch.allclose(velocity.grad, torch.tensor([[0.1875, 0.5625]]))
    assert prev.grad is None


def test_sde_std_dev_t_is_eta_sqrt_sigma_over_one_minus_sigma_and_the_std_over_sqrt_minus_dt():
    sample = torch.zeros(2, 1, 2)
    sigma, sigma_next = torch.tensor([0.5, 1.0]), torch.tensor([0.25, 0.8])
    std_dev_t = sde_std_dev_t(sample, sigma, sigma_next, eta=1.0)
    # row 0: sqrt(0.5 / 0.5) = 1; row 1 (sigma = 1): sqrt(1 / (1 - 0.8)) = sqrt(5)
    assert std_dev_t.shape == (2, 1, 1)
    assert torch.allclose(std_dev_t.flatten(), torch.tensor([1.0, 5**0.5]))
    _, _, _, std = sde_step(sample, sample, sigma, sigma_next, eta=1.0)
    assert torch.equal(std, std_dev_t * torch.sqrt(sigma - sigma_next).view(2, 1, 1))
    assert sde_std_dev_t(sample, 0.5, 0.25, eta=0.7) == 0.7


def test_flow_grpo_kl_at_two_steps_is_flow_grpos_formula_the_exact_kl_times_minus_dt():
    # policy and reference velocities differ by [1, 2]
    sample = torch.ones(1, 2)
    velocity = torch.tensor([[2.0, -1.0]])
    ref_velocity = velocity - torch.tensor([[1.0, 2.0]])

    def kl_at(sigma: float, sigma_next: float, eta: float) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, mean, std = sde_step(velocity, sample, sigma, sigma_next, eta)
        _, _, ref_mean, _ = sde_step(ref_velocity, sample, sigma, sigma_next, eta)
        exact = ((mean - ref_mean) ** 2 / (2 * std**2)).mean(
            dim=1
        )  # KL of N(mean, std^2) || N(ref_mean, std^2)
        return flow_grpo_kl(mean, ref_mean, sde_std_dev_t(sample, sigma, sigma_next, eta)), exact

    # step 0.5 -> 0.25, eta 1: std_dev_t = 1, dt = -0.25, mean - ref_mean = (v - v_ref) * 1.5 * dt
    #   = [-0.375, -0.75] -> mean square 0.3515625 / (2 * 1) = 0.17578125; exact = that / 0.25 = 0.703125
    kl, exact = kl_at(0.5, 0.25, eta=1.0)
    assert torch.allclose(kl, torch.tensor([0.17578125])) and torch.allclose(exact, torch.tensor([0.703125]))
    # step 1 -> 0.8, eta 0.5: std_dev_t^2 = 0.25 * 5 = 1.25, dt = -0.2, factor 1 (1 - sigma = 0): [-0.2, -0.4]
    #   -> mean square 0.1 / 2.5 = 0.04; exact = that / 0.2 = 0.2
    kl, exact = kl_at(1.0, 0.8, eta=0.5)
    assert torch.allclose(kl, torch.tensor([0.04])) and torch.allclose(exact, torch.tensor([0.2]))


def test_flow_grpo_kl_gradient_is_the_mean_gap_over_std_dev_t_squared_per_element():
    mean = torch.tensor([[1.0, 3.0]], requires_grad=True)
    flow_grpo_kl(mean, torch.zeros(1, 2), 2.0).sum().backward()
    # (m_1^2 + m_2^2) / 2 / (2 * 4): d/d m_i = m_i / 8
    assert torch.allclose(mean.grad, torch.tensor([[0.125, 0.375]]))


def test_flow_grpo_kl_rejects_mismatched_means_and_a_non_positive_std_dev_t():
    with pytest.raises(ValueError, match=r"same shape, got mean=\(1, 2\), ref_mean=\(1, 3\)"):
        flow_grpo_kl(torch.zeros(1, 2), torch.zeros(1, 3), 1.0)
    with pytest.raises(ValueError, match=r"std_dev_t must be > 0 \(eta > 0\), got 0.0"):
        flow_grpo_kl(torch.zeros(1, 2), torch.zeros(1, 2), 0.0)
    with pytest.raises(ValueError, match=r"eta must be >= 0, got -1.0"):
        sde_std_dev_t(torch.zeros(1, 2), 0.5, 0.25, eta=-1.0)


def test_sde_step_rejects_negative_eta_and_bad_sigmas():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=r"eta must be >= 0, got -0.1"):
        sde_step(x, x, 0.5, 0.25, eta=-0.1)
    with pytest.raises(ValueError, match=r"sigma must be in \(0, 1\], got 1.5"):
        sde_step(x, x, 1.5, 0.25, eta=1.0)
    with pytest.raises(ValueError, match=r"sigma_next must be in \[0, sigma=0.5\), got 0.5"):
        sde_step(x, x, 0.5, 0.5, eta=1.0)
    with pytest.raises(
        ValueError,
        match=r"sigma must be a float, a 1-element tensor or a \[B\] = \(1,\) tensor, got shape \(3,\)",
    ):
        sde_step(x, x, torch.ones(3) * 0.5, 0.25, eta=1.0)
    with pytest.raises(ValueError, match=r"prev_sample must have the shape of sample \(1, 2\), got \(1, 3\)"):
        sde_step(x, x, 0.5, 0.25, eta=1.0, prev_sample=torch.zeros(1, 3))
