"""Pins unirl_lightning.algorithms.advantages against hand-computed numbers."""

import warnings

import pytest
import torch

from unirl_lightning.algorithms.advantages import gae_advantages, group_advantages, rloo_advantages


def test_grpo_std_is_the_unbiased_group_std_by_default_like_trl_and_verl():
    # group 1: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3 -> A = 0.5 / sqrt(1/3) = sqrt(3) / 2
    # group 2: all equal -> exactly 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    advantages = group_advantages(rewards, group_size=4, eps=0.0)
    half_sqrt3 = 3**0.5 / 2
    assert torch.allclose(
        advantages, torch.tensor([half_sqrt3, -half_sqrt3, -half_sqrt3, half_sqrt3, 0.0, 0.0, 0.0, 0.0])
    )
    assert torch.equal(advantages[4:], torch.zeros(4))


def test_grpo_population_std_is_kept_as_an_option_like_flow_grpo():
    # population std of [1, 0, 0, 1] is 0.5 -> [1, -1, -1, 1] exactly
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    advantages = group_advantages(rewards, group_size=4, eps=0.0, std="population")
    assert torch.equal(advantages, torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0]))


def test_grpo_default_eps_is_trls_1e_minus_4():
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4)
    expected = 0.5 / (3**-0.5 + 1e-4)  # 0.865875...
    assert torch.allclose(
        advantages, torch.tensor([expected, -expected, -expected, expected]), rtol=0, atol=1e-7
    )


def test_grpo_eps_is_added_to_the_std():
    # unbiased std of [1, 0] = sqrt(0.5): 0.5 / (sqrt(0.5) + 0.5) = 1 / (sqrt(2) + 1) = sqrt(2) - 1
    advantages = group_advantages(torch.tensor([1.0, 0.0]), group_size=2, eps=0.5)
    assert torch.allclose(advantages, torch.tensor([2**0.5 - 1, 1 - 2**0.5]))
    # population std 0.5: (1 - 0.5) / (0.5 + 0.5) = 0.5
    advantages = group_advantages(torch.tensor([1.0, 0.0]), group_size=2, eps=0.5, std="population")
    assert torch.allclose(advantages, torch.tensor([0.5, -0.5]))


def test_a_group_of_one_is_exactly_zero_with_either_std_and_no_degrees_of_freedom_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for std in ("unbiased", "population"):
            assert torch.equal(
                group_advantages(torch.tensor([0.3, 2.0]), group_size=1, std=std), torch.zeros(2)
            )


def test_dr_grpo_mean_normalisation_only_subtracts_the_group_mean():
    rewards = torch.tensor([3.0, 1.0, 2.0, 0.0, 0.0, 6.0])
    advantages = group_advantages(rewards, group_size=3, normalize="mean")
    # means 2 and 2
    assert torch.allclose(advantages, torch.tensor([1.0, -1.0, 0.0, -2.0, -2.0, 4.0]))


def test_all_equal_group_is_exactly_zero_despite_rounding_of_the_mean():
    # 0.1 * 3 / 3 != 0.1 in float32; without the explicit zeroing this would be noise / eps
    advantages = group_advantages(torch.tensor([0.1, 0.1, 0.1]), group_size=3)
    assert torch.equal(advantages, torch.zeros(3))


def test_integer_rewards_are_accepted_and_give_float_advantages():
    advantages = group_advantages(torch.tensor([1, 0]), group_size=2, eps=0.0, std="population")
    assert advantages.dtype == torch.float32
    assert torch.equal(advantages, torch.tensor([1.0, -1.0]))


def test_group_advantages_rejects_bad_arguments_naming_value_and_allowed():
    with pytest.raises(ValueError, match=r"group_size must be an int >= 1, got 0"):
        group_advantages(torch.zeros(4), group_size=0)
    with pytest.raises(ValueError, match=r"len\(rewards\)=5 must be a positive multiple of group_size=2"):
        group_advantages(torch.zeros(5), group_size=2)
    with pytest.raises(ValueError, match=r"normalize must be one of \('std', 'mean'\), got 'max'"):
        group_advantages(torch.zeros(4), group_size=2, normalize="max")
    with pytest.raises(ValueError, match=r"std must be one of \('unbiased', 'population'\), got 'sample'"):
        group_advantages(torch.zeros(4), group_size=2, std="sample")
    with pytest.raises(ValueError, match=r"rewards must be 1-D .* got shape \(2, 2\)"):
        group_advantages(torch.zeros(2, 2), group_size=2)


def test_rloo_baseline_is_the_mean_of_the_other_samples():
    # group [1, 0, 0, 1]: A_0 = 1 - (0+0+1)/3 = 2/3, A_1 = 0 - (1+0+1)/3 = -2/3
    # group [3, 0]: A_0 = 3 - 0 = 3, A_1 = 0 - 3 = -3
    advantages = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4)
    assert torch.allclose(advantages, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    assert torch.allclose(rloo_advantages(torch.tensor([3.0, 0.0]), group_size=2), torch.tensor([3.0, -3.0]))


def test_rloo_needs_at_least_two_samples_per_group():
    with pytest.raises(ValueError, match=r"group_size must be an int >= 2, got 1"):
        rloo_advantages(torch.zeros(4), group_size=1)


def test_gae_matches_the_hand_unrolled_recursion():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.5, 0.5]])
    mask = torch.ones(1, 3)
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    # t=2: delta = 1 - 0.5 = 0.5;                         A2 = 0.5
    # t=1: delta = 0 + 0.9*0.5 - 0.5 = -0.05;             A1 = -0.05 + 0.45*0.5   = 0.175
    # t=0: delta = -0.05;                                 A0 = -0.05 + 0.45*0.175 = 0.02875
    assert torch.allclose(advantages, torch.tensor([[0.02875, 0.175, 0.5]]))
    assert torch.allclose(returns, torch.tensor([[0.52875, 0.675, 1.0]]))


def test_gae_with_gamma_lam_one_is_return_minus_value():
    advantages, returns = gae_advantages(
        torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.2, 0.4, 0.6]]), torch.ones(1, 3), gamma=1.0, lam=1.0
    )
    assert torch.allclose(advantages, torch.tensor([[0.8, 0.6, 0.4]]))
    assert torch.allclose(returns, torch.ones(1, 3))


def test_gae_padding_does_not_leak_across_the_end_of_a_sequence():
    # the padded position holds a huge reward and value; the last valid token must see V_next = 0
    rewards = torch.tensor([[0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.5, 9.0]])
    mask = torch.tensor([[1, 1, 0]])
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    assert torch.allclose(advantages, torch.tensor([[0.175, 0.5, 0.0]]))
    assert torch.allclose(returns, torch.tensor([[0.675, 1.0, 0.0]]))


def test_gae_skips_interior_masked_tokens():
    # the masked middle token (e.g. tool output) is jumped over: token 0 bootstraps from token 2
    rewards = torch.tensor([[0.0, 7.0, 1.0]])
    values = torch.tensor([[0.5, 3.0, 0.5]])
    mask = torch.tensor([[True, False, True]])
    advantages, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    # same as the two-token sequence [0, 1] / [0.5, 0.5]: A = [0.175, 0.5]
    assert torch.allclose(advantages, torch.tensor([[0.175, 0.0, 0.5]]))


def test_gae_rejects_mismatched_shapes_and_out_of_range_gamma():
    with pytest.raises(ValueError, match=r"same shape, got rewards=\(1, 3\), values=\(1, 2\)"):
        gae_advantages(torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 3), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\], got 1.5"):
        gae_advantages(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3), gamma=1.5, lam=1.0)
    with pytest.raises(ValueError, match=r"lam must be in \[0, 1\], got -0.1"):
        gae_advantages(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3), gamma=1.0, lam=-0.1)
