"""Pins unirl_lightning.algorithms.losses against hand-computed numbers."""

import math

import pytest
import torch

from unirl_lightning.algorithms.kl import kl_penalty
from unirl_lightning.algorithms.losses import (
    aggregate_loss,
    cispo_loss,
    dual_clip,
    gspo_loss,
    masked_mean,
    ppo_clip_loss,
    safe_log_ratio,
)

# one sequence of four tokens whose ratios pi/pi_old are 1.5, 0.5, 1.0, 1.1
RATIOS = torch.tensor([[1.5, 0.5, 1.0, 1.1]])
OLD_LOGP = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
LOGP = OLD_LOGP + RATIOS.log()
MASK = torch.ones(1, 4)


def test_masked_mean_ignores_masked_positions_even_inf_and_nan():
    x = torch.tensor([[1.0, 2.0], [3.0, float("inf")]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert masked_mean(x, mask) == 2.0
    assert torch.equal(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 3.0]))
    assert masked_mean(torch.tensor([float("nan"), 4.0]), torch.tensor([False, True])) == 4.0


def test_masked_mean_of_an_all_masked_slice_is_zero_not_nan():
    assert torch.equal(
        masked_mean(torch.ones(2, 2), torch.tensor([[1, 1], [0, 0]]), dim=-1), torch.tensor([1.0, 0.0])
    )


def test_masked_mean_rejects_a_mask_of_another_shape():
    with pytest.raises(ValueError, match=r"mask must have the shape of x \(2,\), got \(3,\)"):
        masked_mean(torch.ones(2), torch.ones(3))


LOSS_TOKENS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
LOSS_MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


def test_token_mean_weighs_every_valid_token_equally():
    # (1 + 2 + 3 + 4) / 4; max_tokens is ignored outside seq-mean-token-sum-norm
    assert aggregate_loss(LOSS_TOKENS, LOSS_MASK, "token-mean") == 2.5
    assert aggregate_loss(LOSS_TOKENS, LOSS_MASK, "token-mean", max_tokens=100) == 2.5


def test_seq_mean_token_mean_weighs_every_sequence_equally_and_an_empty_one_counts_as_zero_like_trl():
    # (mean[1, 2, 3] + mean[4] + 0) / 3 = (2 + 4 + 0) / 3: divided by all B rows, as TRL's "grpo"
    assert aggregate_loss(LOSS_TOKENS, LOSS_MASK, "seq-mean-token-mean") == 2.0


def test_seq_mean_token_sum_norm_divides_by_the_constant_max_tokens_dr_grpo():
    # (6 / 4 + 4 / 4 + 0 / 4) / 3 sequences = 10 / 12; not the padded width 3
    assert torch.allclose(
        aggregate_loss(LOSS_TOKENS, LOSS_MASK, "seq-mean-token-sum-norm", max_tokens=4), torch.tensor(10 / 12)
    )


def test_seq_mean_token_sum_norm_does_not_depend_on_prompt_width_or_padding():
    # the same completions behind 2 more prompt columns and before 3 more padding columns (garbage there)
    wide_tokens = torch.cat([torch.full((3, 2), 5.0), LOSS_TOKENS, torch.full((3, 3), float("nan"))], dim=1)
    wide_mask = torch.cat([torch.zeros(3, 2), LOSS_MASK, torch.zeros(3, 3)], dim=1)
    narrow = aggregate_loss(LOSS_TOKENS, LOSS_MASK, "seq-mean-token-sum-norm", max_tokens=4)
    wide = aggregate_loss(wide_tokens, wide_mask, "seq-mean-token-sum-norm", max_tokens=4)
    assert wide == narrow


def test_seq_mean_token_sum_norm_requires_max_tokens_naming_the_budget():
    for bad in (None, 0, True, 4.0):
        with pytest.raises(
            ValueError,
            match=r"aggregation 'seq-mean-token-sum-norm' needs max_tokens, the generation budget "
            rf"\(max_new_tokens\), as an int >= 1, got {bad!r}",
        ):
            aggregate_loss(LOSS_TOKENS, LOSS_MASK, "seq-mean-token-sum-norm", max_tokens=bad)
    with pytest.raises(ValueError, match=r"needs max_tokens.*got None"):
        ppo_clip_loss(LOGP, OLD_LOGP, torch.ones(1), MASK, aggregation="seq-mean-token-sum-norm")


def test_aggregate_loss_rejects_unknown_mode_listing_the_allowed():
    with pytest.raises(
        ValueError,
        match=r"one of \('token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum-norm'\), got 'sum'",
    ):
        aggregate_loss(LOSS_TOKENS, LOSS_MASK, "sum")


def test_ppo_clip_positive_advantage_clips_ratios_above_one_plus_clip():
    loss, metrics = ppo_clip_loss(LOGP, OLD_LOGP, torch.tensor([1.0]), MASK)
    # pg_loss1 = -r = [-1.5, -0.5, -1, -1.1]; pg_loss2 = -clamp(r, 0.8, 1.2) = [-1.2, -0.8, -1, -1.1]
    # max = [-1.2, -0.5, -1, -1.1] -> mean -0.95; only the first token is clipped
    assert torch.allclose(loss, torch.tensor(-0.95))
    assert metrics["pg_loss"] == loss  # no token_penalty: the policy term is the whole loss
    assert torch.allclose(metrics["ratio_mean"], torch.tensor(1.025))  # (1.5 + 0.5 + 1 + 1.1) / 4
    assert metrics["clip_fraction"] == 0.25
    # k3: mean of (r - 1) - log r = (0.094535 + 0.193147 + 0 + 0.004690) / 4
    assert torch.allclose(metrics["approx_kl"], torch.tensor(0.0730930))


def test_ppo_clip_negative_advantage_clips_ratios_below_one_minus_clip():
    loss, metrics = ppo_clip_loss(LOGP, OLD_LOGP, torch.tensor([-1.0]), MASK)
    # pg_loss1 = r = [1.5, 0.5, 1, 1.1]; pg_loss2 = [1.2, 0.8, 1, 1.1]; max = [1.5, 0.8, 1, 1.1]
    assert torch.allclose(loss, torch.tensor(4.4 / 4))
    assert metrics["clip_fraction"] == 0.25


def test_clipped_tokens_get_zero_gradient_and_unclipped_get_minus_a_ratio_over_n():
    logp = LOGP.clone().requires_grad_(True)
    loss, _ = ppo_clip_loss(logp, OLD_LOGP, torch.tensor([1.0]), MASK)
    loss.backward()
    # d(-A r)/d logp = -A r, divided by 4 tokens; token 0 is clipped
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.5 / 4, -1.0 / 4, -1.1 / 4]]))


def test_clip_higher_uses_the_asymmetric_upper_bound_dapo():
    loss, metrics = ppo_clip_loss(LOGP, OLD_LOGP, torch.tensor([1.0]), MASK, clip_low=0.2, clip_high=0.28)
    # token 0: max(-1.5, -1.28) = -1.28 -> (-1.28 - 0.5 - 1 - 1.1) / 4
    assert torch.allclose(loss, torch.tensor(-3.88 / 4))
    assert metrics["clip_fraction"] == 0.25


def test_per_token_advantages_masked_garbage_does_not_leak_into_loss_or_gradient():
    advantages = torch.tensor([[1.0, 2.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    logp = LOGP.clone()
    logp[0, 3] = 1e4  # garbage on a masked token: exp() would overflow if it were not masked first
    logp.requires_grad_(True)
    loss, metrics = ppo_clip_loss(
        logp, OLD_LOGP, advantages, mask, aggregation="seq-mean-token-sum-norm", max_tokens=4
    )
    # token 0: max(-1.5, -1.2) = -1.2; token 1: A=2, max(-1.0, -1.6) = -1.0; token 2: r=1 -> 1.0
    # sum -1.2 over max_tokens 4
    assert torch.allclose(loss, torch.tensor(-1.2 / 4))
    assert torch.allclose(metrics["ratio_mean"], torch.tensor(1.0))  # (1.5 + 0.5 + 1) / 3
    loss.backward()
    assert logp.grad[0, 3] == 0.0  # not nan


def test_is_weights_multiply_the_token_losses_and_carry_no_gradient():
    is_weights = torch.tensor([[2.0, 0.0, 1.0, 1.0]], requires_grad=True)
    logp = LOGP.clone().requires_grad_(True)
    loss, _ = ppo_clip_loss(logp, OLD_LOGP, torch.tensor([1.0]), MASK, is_weights=is_weights)
    # [-1.2 * 2, -0.5 * 0, -1, -1.1] / 4
    assert torch.allclose(loss, torch.tensor(-4.5 / 4))
    loss.backward()
    assert is_weights.grad is None


# two on-policy sequences (ratio 1) of 1 and 3 valid tokens; 9.0 on a masked token is garbage
PENALTY = torch.tensor([[2.0, 9.0, 9.0], [1.0, 0.5, 0.0]])
PENALTY_MASK = torch.tensor([[1, 0, 0], [1, 1, 1]])


def test_token_penalty_is_added_per_token_before_aggregation_like_trl():
    logp = torch.zeros(2, 3)
    advantages = torch.tensor([1.0, 2.0])  # policy tokens: -A * 1 = -1 (seq 0) and -2 (seq 1)
    loss, metrics = ppo_clip_loss(
        logp, logp, advantages, PENALTY_MASK, aggregation="seq-mean-token-mean", token_penalty=PENALTY
    )
    # seq 0: -1 + 2 = 1; seq 1: mean(-2 + 1, -2 + 0.5, -2 + 0) = -1.5 -> (1 - 1.5) / 2
    # (adding the token-mean of the penalty after aggregation would give -1.5 + 3.5 / 4 = -0.625)
    assert loss == -0.25
    assert metrics["pg_loss"] == -1.5  # (-1 - 2) / 2, the policy term alone
    loss, metrics = ppo_clip_loss(
        logp,
        logp,
        advantages,
        PENALTY_MASK,
        aggregation="seq-mean-token-sum-norm",
        max_tokens=4,
        token_penalty=PENALTY,
    )
    # seq 0: (-1 + 2) / 4 = 0.25; seq 1: (-1 - 1.5 - 2) / 4 = -1.125 -> (0.25 - 1.125) / 2
    assert loss == -0.4375
    assert metrics["pg_loss"] == -0.875  # (-1 / 4 - 6 / 4) / 2


def test_token_penalty_is_not_reweighted_by_the_importance_weights():
    is_weights = torch.tensor([[2.0, 0.0, 1.0, 1.0]])
    penalty = torch.tensor([[0.0, 4.0, 0.0, 0.0]])  # on the token whose importance weight is 0
    loss, metrics = ppo_clip_loss(
        LOGP, OLD_LOGP, torch.tensor([1.0]), MASK, is_weights=is_weights, token_penalty=penalty
    )
    # policy: [-1.2 * 2, -0.5 * 0, -1, -1.1] / 4 = -4.5 / 4; penalty: 4 / 4 = 1, not 0
    assert torch.allclose(metrics["pg_loss"], torch.tensor(-4.5 / 4))
    assert torch.allclose(loss, torch.tensor(-4.5 / 4 + 1.0))


def test_token_penalty_carries_its_gradient_to_logp():
    logp = torch.zeros(1, 2, requires_grad=True)
    ref_logp = torch.tensor([[-1.0, 1.0]])
    penalty = 0.5 * kl_penalty(logp, ref_logp, "k1")  # d/d logp = 0.5 per token
    loss, _ = ppo_clip_loss(logp, logp.detach(), torch.zeros(1), torch.ones(1, 2), token_penalty=penalty)
    loss.backward()
    # advantage 0: only the penalty has a gradient, 0.5 over 2 tokens
    assert torch.equal(logp.grad, torch.tensor([[0.25, 0.25]]))


def test_ratio_is_exactly_one_on_policy():
    logp = torch.tensor([[-0.3, -1.7]])
    loss, metrics = ppo_clip_loss(logp, logp.clone(), torch.tensor([2.0]), torch.ones(1, 2))
    assert loss == -2.0
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_fraction"] == 0.0 and metrics["approx_kl"] == 0.0


def test_ppo_clip_rejects_bad_shapes_and_clip_ranges():
    with pytest.raises(
        ValueError, match=r"advantages must be \[B\] = \(1,\) or \[B, T\] = \(1, 4\), got \(2,\)"
    ):
        ppo_clip_loss(LOGP, OLD_LOGP, torch.ones(2), MASK)
    with pytest.raises(ValueError, match=r"clip_low must be in \[0, 1\), got 1.5"):
        ppo_clip_loss(LOGP, OLD_LOGP, torch.ones(1), MASK, clip_low=1.5)
    with pytest.raises(ValueError, match=r"clip_high must be >= 0, got -0.1"):
        ppo_clip_loss(LOGP, OLD_LOGP, torch.ones(1), MASK, clip_high=-0.1)
    with pytest.raises(ValueError, match=r"same shape, got logp=\(1, 4\), old_logp=\(1, 3\)"):
        ppo_clip_loss(LOGP, OLD_LOGP[:, :3], torch.ones(1), MASK)
    with pytest.raises(ValueError, match=r"is_weights must be \[B, T\] = \(1, 4\), got \(4,\)"):
        ppo_clip_loss(LOGP, OLD_LOGP, torch.ones(1), MASK, is_weights=torch.ones(4))
    with pytest.raises(ValueError, match=r"token_penalty must be \[B, T\] = \(1, 4\), got \(1, 3\)"):
        ppo_clip_loss(LOGP, OLD_LOGP, torch.ones(1), MASK, token_penalty=torch.ones(1, 3))


def test_gspo_ratio_is_the_geometric_mean_of_valid_token_ratios_clipped_per_sequence():
    old_logp = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]])
    logp = old_logp + torch.tensor([[0.0002, 0.0004], [0.001, 7.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = gspo_loss(logp, old_logp, torch.tensor([1.0, 1.0]), mask)
    # seq 0: exp(0.0003) = 1.00030005, inside [1 - 3e-4, 1 + 4e-4]
    # seq 1: exp(0.001) = 1.00100050 (the masked 7.0 is ignored), clipped to 1.0004
    assert torch.allclose(loss, torch.tensor(-(1.00030005 + 1.0004) / 2))
    assert torch.allclose(metrics["ratio_mean"], torch.tensor((1.00030005 + 1.0010005) / 2))
    assert metrics["clip_fraction"] == 0.5


def test_gspo_an_empty_sequence_counts_as_zero_in_the_mean_over_all_sequences():
    logp = torch.zeros(2, 2)
    loss, metrics = gspo_loss(logp, logp, torch.tensor([1.0, 5.0]), torch.tensor([[1, 1], [0, 0]]))
    # seq 0: -1 * ratio 1; seq 1 has no token: 0, not -5 -> (-1 + 0) / 2
    assert loss == -0.5
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_fraction"] == 0.0


def test_gspo_gradient_is_spread_evenly_over_the_sequence_tokens():
    old_logp = torch.zeros(1, 2)
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = gspo_loss(logp, old_logp, torch.tensor([2.0]), torch.ones(1, 2))
    loss.backward()
    # loss = -A exp(mean(logp)) -> d/d logp_t = -A * 1 / 2
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.0]]))


def test_gspo_requires_one_advantage_per_sequence():
    with pytest.raises(
        ValueError, match=r"advantages must be \[B\] = \(1,\) \(one per sequence\), got \(1, 4\)"
    ):
        gspo_loss(LOGP, OLD_LOGP, torch.ones(1, 4), MASK)


def test_gspo_approx_kl_is_the_token_level_k3():
    _, metrics = gspo_loss(LOGP, OLD_LOGP, torch.tensor([1.0]), MASK)
    assert torch.allclose(metrics["approx_kl"], torch.tensor(0.0730930))


# -- safe ratios and dual-clip ------------------------------------------------------------------
def test_log_ratio_is_clamped_to_plus_minus_20_before_exp():
    logp = torch.tensor([[100.0, -100.0, 0.5, 7.0]])
    log_ratio = safe_log_ratio(logp, torch.zeros(1, 4), torch.tensor([[1, 1, 1, 0]]))
    assert torch.equal(log_ratio, torch.tensor([[20.0, -20.0, 0.5, 0.0]]))  # masked: 0


def test_a_very_stale_token_gives_a_finite_loss_and_no_nan_gradient():
    # log ratio 100: exp() overflows float32 to inf without the clamp; with it the ratio is e^20
    logp = torch.tensor([[100.0, 0.0]], requires_grad=True)
    loss, metrics = ppo_clip_loss(logp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2))
    # A = -1: max(r, clamp(r, 0.8, 1.2)) = [e^20, 1] -> mean
    assert torch.isfinite(loss) and torch.allclose(loss, torch.tensor((math.exp(20) + 1) / 2))
    assert torch.isfinite(metrics["ratio_mean"]) and torch.isfinite(metrics["approx_kl"])
    loss.backward()
    assert torch.equal(logp.grad, torch.tensor([[0.0, 0.5]]))  # the clamped token: 0, not nan


# ratios 5.0, 1.5, 0.5, 2.5 against the behaviour policy
DUAL_RATIOS = torch.tensor([[5.0, 1.5, 0.5, 2.5]])
DUAL_LOGP = OLD_LOGP + DUAL_RATIOS.log()


def test_dual_clip_caps_the_loss_of_negative_advantage_tokens_at_minus_a_times_c():
    logp = DUAL_LOGP.clone().requires_grad_(True)
    loss, metrics = ppo_clip_loss(logp, OLD_LOGP, torch.tensor([-1.0]), MASK, clip_ratio_c=3.0)
    # A = -1: pg_loss1 = r = [5, 1.5, 0.5, 2.5]; pg_loss2 = clamp(r, 0.8, 1.2) = [1.2, 1.2, 0.8, 1.2]
    # max = [5, 1.5, 0.8, 2.5]; dual-clip min(., -A * 3 = 3) = [3, 1.5, 0.8, 2.5] -> 7.8 / 4
    assert torch.allclose(loss, torch.tensor(1.95))
    assert metrics["clip_fraction"] == 0.25  # token 2 (pg_loss2 > pg_loss1)
    assert metrics["dual_clip_fraction"] == 0.25  # token 0
    loss.backward()
    # d(-A r)/d logp = r / 4 where neither clip holds; 0 on the capped and the clipped token
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 1.5 / 4, 0.0, 2.5 / 4]]))


def test_dual_clip_leaves_positive_advantages_and_ratios_below_c_alone():
    for advantage in (1.0, -1.0):
        ratios_below_c = (LOGP, OLD_LOGP, torch.tensor([advantage]), MASK)  # ratios 1.5, 0.5, 1, 1.1
        assert ppo_clip_loss(*ratios_below_c, clip_ratio_c=3.0)[0] == ppo_clip_loss(*ratios_below_c)[0]
    with_c, _ = ppo_clip_loss(DUAL_LOGP, OLD_LOGP, torch.tensor([1.0]), MASK, clip_ratio_c=3.0)
    assert with_c == ppo_clip_loss(DUAL_LOGP, OLD_LOGP, torch.tensor([1.0]), MASK)[0]
    # per token, as verl: where(A < 0, min(loss, -A c), loss)
    assert torch.equal(
        dual_clip(torch.tensor([5.0, 5.0, 1.0]), torch.tensor([-1.0, 1.0, -1.0]), 3.0),
        torch.tensor([3.0, 5.0, 1.0]),
    )


def test_dual_clip_must_exceed_one_and_is_refused_at_the_sequence_level():
    with pytest.raises(ValueError, match=r"clip_ratio_c must be > 1 \(or None: no dual clip\), got 1.0"):
        ppo_clip_loss(LOGP, OLD_LOGP, torch.ones(1), MASK, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match=r"clip_ratio_c=3.0 with ratio_level='sequence'"):
        ppo_clip_loss(LOGP, OLD_LOGP, torch.ones(1), MASK, clip_ratio_c=3.0, ratio_level="sequence")
    with pytest.raises(ValueError, match=r"ratio_level must be one of \('token', 'sequence'\), got 'group'"):
        ppo_clip_loss(LOGP, OLD_LOGP, torch.ones(1), MASK, ratio_level="group")


# -- sequence-level ratio (GSPO) in ppo_clip_loss ------------------------------------------------
SEQ_OLD = torch.zeros(2, 2)
SEQ_LOGP = torch.tensor([[0.1, 0.3], [0.05, 9.0]])  # 9.0 is on a masked token
SEQ_MASK = torch.tensor([[1, 1], [1, 0]])


def test_sequence_ratio_is_broadcast_to_tokens_so_token_mean_weighs_sequences_by_length():
    loss, metrics = ppo_clip_loss(
        SEQ_LOGP, SEQ_OLD, torch.tensor([1.0, 1.0]), SEQ_MASK, ratio_level="sequence"
    )
    # seq ratios exp(0.2) = 1.22140 (clipped to 1.2) and exp(0.05) = 1.05127 -> pg = [-1.2, -1.05127]
    # token-mean: seq 0 has 2 tokens, seq 1 one -> (2 * -1.2 - 1.05127) / 3
    assert torch.allclose(loss, torch.tensor(-1.1504237))
    assert torch.allclose(metrics["ratio_mean"], torch.tensor((1.2214028 + 1.0512711) / 2))  # per sequence
    assert metrics["clip_fraction"] == 0.5  # one sequence of two
    seq_mean, _ = ppo_clip_loss(
        SEQ_LOGP,
        SEQ_OLD,
        torch.tensor([1.0, 1.0]),
        SEQ_MASK,
        aggregation="seq-mean-token-mean",
        ratio_level="sequence",
    )
    assert torch.allclose(seq_mean, torch.tensor((-1.2 - 1.0512711) / 2))


def test_gspo_loss_is_ppo_clip_loss_at_the_sequence_level_with_seq_mean_token_mean():
    advantages = torch.tensor([0.5, -2.0])
    gspo, gspo_metrics = gspo_loss(SEQ_LOGP, SEQ_OLD, advantages, SEQ_MASK, 0.1, 0.1)
    ppo, ppo_metrics = ppo_clip_loss(
        SEQ_LOGP, SEQ_OLD, advantages, SEQ_MASK, 0.1, 0.1, "seq-mean-token-mean", ratio_level="sequence"
    )
    assert gspo == ppo and gspo_metrics == ppo_metrics


# -- CISPO ---------------------------------------------------------------------------------------
def test_cispo_weighs_logp_by_the_truncated_ratio_and_keeps_every_tokens_gradient():
    logp = LOGP.clone().requires_grad_(True)  # ratios 1.5, 0.5, 1.0, 1.1
    loss, metrics = cispo_loss(logp, OLD_LOGP, torch.tensor([1.0]), MASK, cap=1.2)
    # w = min(r, 1.2) = [1.2, 0.5, 1.0, 1.1]; loss = -mean(w * A * logp) with
    # logp = [-0.594535, -2.693147, -0.5, -2.904690] -> 5.755174 / 4
    assert torch.allclose(loss, torch.tensor(1.4387935))
    assert metrics["pg_loss"] == loss
    assert metrics["clip_fraction"] == 0.25  # token 0's weight was truncated
    assert torch.allclose(metrics["ratio_mean"], torch.tensor(1.025))
    loss.backward()
    # d/d logp = -w * A / 4 (w is a constant): token 0, clipped away by PPO, keeps -1.2 / 4
    assert torch.allclose(logp.grad, torch.tensor([[-0.3, -0.125, -0.25, -0.275]]))


def test_cispo_masked_garbage_does_not_leak_and_is_weights_and_penalty_compose_like_ppo():
    logp = LOGP.clone()
    logp[0, 3] = float("nan")
    logp.requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 0]])
    is_weights = torch.tensor([[2.0, 1.0, 1.0, 1.0]])
    penalty = torch.tensor([[0.0, 0.3, 0.0, 0.0]])
    loss, metrics = cispo_loss(
        logp, OLD_LOGP, torch.tensor([1.0]), mask, cap=1.2, is_weights=is_weights, token_penalty=penalty
    )
    # policy: -[1.2 * 2 * -0.594535, 0.5 * -2.693147, 1.0 * -0.5] / 3; penalty 0.3 / 3
    policy = (2.4 * 0.5945349 + 0.5 * 2.6931472 + 0.5) / 3
    assert torch.allclose(metrics["pg_loss"], torch.tensor(policy))
    assert torch.allclose(loss, torch.tensor(policy + 0.1))
    loss.backward()
    assert logp.grad[0, 3] == 0.0


def test_cispo_rejects_a_non_positive_cap_and_bad_shapes():
    with pytest.raises(ValueError, match=r"cap must be > 0, got 0.0"):
        cispo_loss(LOGP, OLD_LOGP, torch.ones(1), MASK, cap=0.0)
    with pytest.raises(ValueError, match=r"advantages must be \[B\] = \(1,\) or \[B, T\] = \(1, 4\)"):
        cispo_loss(LOGP, OLD_LOGP, torch.ones(3), MASK)
