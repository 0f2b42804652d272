"""The loss options of the causal-LM modules (dual-clip, GSPO ratios, CISPO, entropy bonus,
sequence-level mismatch masking, truncated-completion masking, overlong penalty): refused
combinations name their keys at construction, and each option's loss is the pure function's."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from tests.builders import tiny_module
from tests.integration.parse_only import ParseOnlyCLI, init_args
from unirl_lightning.algorithms import (
    cispo_loss,
    group_advantages,
    gspo_loss,
    masked_mean,
    ppo_clip_loss,
    sequence_masked_importance_weights,
)
from unirl_lightning.cli.app import run_cli
from unirl_lightning.modules import PPOModule
from unirl_lightning.modules.agentic_grpo import AgenticGRPOModule
from unirl_lightning.modules.causal_lm import CausalLMModule
from unirl_lightning.rollout.batches import ExperienceBatch
from unirl_lightning.rollout.records import Rollout

PROMPT = [18]
EOS = 2  # TinyCausalLM's eos, its only stop token


def batch_of(completions: list[list[int]], rewards: list[float]) -> ExperienceBatch:
    """One group, one row per completion, behaviour log-probs -1 - 0.1 * position."""
    rows = [
        Rollout(PROMPT, ids, [-1.0 - 0.1 * i for i in range(len(ids))], reward, "stop")
        for ids, reward in zip(completions, rewards)
    ]
    return ExperienceBatch.collate([rows], pad_token_id=0)


# budget 2: truncated (no stop token), finished at the budget, short, truncated
BATCH_ROWS = ([[5, 6], [5, EOS], [7], [8, 9]], [1.0, 0.0, 0.5, 0.0])


def module_and_inputs(**overrides):
    torch.manual_seed(0)
    module = tiny_module(**overrides)
    module.setup("fit")
    batch = batch_of(*BATCH_ROWS)
    return module, batch, module.prepare_batch(batch)


def grads(module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.policy.parameters() if p.grad is not None]


# -- construction-time refusals ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"clip_ratio_c": 1.0}, r"clip_ratio_c must be in \(1, inf\), got 1.0"),
        (
            {"ratio_level": "sequence"},
            r"clip_ratio_c \(dual-clip\) is defined at ratio_level='token' only: set clip_ratio_c=None "
            r"\(YAML: null\) with ratio_level='sequence', got clip_ratio_c=3.0",
        ),
        (
            {"loss": "cispo"},
            r"clip_ratio_c \(dual-clip\) is defined for loss='ppo' only .* set clip_ratio_c=None "
            r"\(YAML: null\) with loss='cispo', got clip_ratio_c=3.0",
        ),
        (
            {"loss": "cispo", "clip_ratio_c": None, "ratio_level": "sequence"},
            r"loss='cispo' is defined at ratio_level='token' only, got ratio_level='sequence'",
        ),
        ({"loss": "grpo"}, r"loss must be one of \('ppo', 'cispo'\), got 'grpo'"),
        ({"ratio_level": "group"}, r"ratio_level must be one of \('token', 'sequence'\), got 'group'"),
        ({"loss": "cispo", "clip_ratio_c": None, "cispo_cap": 0.5}, r"cispo_cap must be >= 1, got 0.5"),
        ({"entropy_coef": -0.01}, r"entropy_coef must be >= 0, got -0.01"),
        (
            {"sequence_mask_cap": 2.0},
            r"sequence_mask_cap needs old_logprob='recompute' \(the weights are pi_trainer / pi_rollout\), "
            r"got old_logprob='rollout'",
        ),
        (
            {"sequence_mask_cap": 1.0, "old_logprob": "recompute"},
            r"sequence_mask_cap must be in \(1, inf\), got 1.0",
        ),
        (
            {"sequence_mask_cap": 2.0, "tis_cap": 2.0, "old_logprob": "recompute"},
            r"tis_cap and sequence_mask_cap correct the same mismatch .* got tis_cap=2.0, sequence_mask_cap=2.0",
        ),
        ({"tis_cap": 0.0, "old_logprob": "recompute"}, r"tis_cap must be > 0, got 0.0"),
        ({"overlong_buffer": 3}, r"overlong_buffer must be in \[0, 2\], got 3"),  # max_new_tokens 2
        ({"overlong_penalty": -1.0}, r"overlong_penalty must be >= 0, got -1.0"),
    ],
)
def test_bad_loss_options_are_refused_naming_the_keys_and_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_module(**overrides)


def test_ppo_refuses_sequence_ratios_its_gae_advantages_are_per_token():
    with pytest.raises(
        ValueError, match=r"PPOModule's GAE advantages are per token: .*ratio_level='sequence'"
    ):
        tiny_module(PPOModule, ratio_level="sequence", clip_ratio_c=None)


@pytest.mark.parametrize(("key", "value"), [("mask_truncated", True), ("overlong_buffer", 1)])
def test_agentic_grpo_refuses_the_per_sequence_budget_options(key, value):
    with pytest.raises(ValueError, match=rf"{key} reads a completion's length .* got {key}={value!r}"):
        AgenticGRPOModule(env="unirl_lightning.envs:GuessingGameEnv", **{key: value})


# -- each option's loss --------------------------------------------------------------------------
def test_the_defaults_are_todays_ppo_clip_loss_plus_the_dual_clip_metric():
    module, batch, context = module_and_inputs()
    loss, metrics = module.policy_loss(batch, context)
    logp = module.sequence_logprobs(module.policy, batch)
    mask, rollout_logp = batch.response_mask[:, 1:], batch.rollout_logprobs[:, 1:]
    expected, _ = ppo_clip_loss(logp, rollout_logp, context.advantages, mask, 0.2, 0.2, "token-mean")
    assert torch.allclose(loss, expected)
    assert metrics["dual_clip_fraction"] == 0.0  # no ratio above 3 with a negative advantage
    assert {"clip_fraction", "entropy", "logp_diff_abs"} <= set(metrics)


def test_ratio_level_sequence_is_gspo():
    module, batch, context = module_and_inputs(
        ratio_level="sequence",
        clip_ratio_c=None,
        clip_low=3e-4,
        clip_high=4e-4,
        loss_aggregation="seq-mean-token-mean",
    )
    loss, metrics = module.policy_loss(batch, context)
    logp = module.sequence_logprobs(module.policy, batch)
    expected, expected_metrics = gspo_loss(
        logp, batch.rollout_logprobs[:, 1:], context.advantages, batch.response_mask[:, 1:]
    )
    assert torch.allclose(loss, expected)
    assert torch.allclose(metrics["clip_fraction"], expected_metrics["clip_fraction"])


def test_loss_cispo_is_cispo_loss_with_cispo_cap():
    module, batch, context = module_and_inputs(loss="cispo", clip_ratio_c=None, cispo_cap=1.5)
    loss, metrics = module.policy_loss(batch, context)
    logp = module.sequence_logprobs(module.policy, batch)
    expected, _ = cispo_loss(
        logp, batch.rollout_logprobs[:, 1:], context.advantages, batch.response_mask[:, 1:], 1.5
    )
    assert torch.allclose(loss, expected)
    assert "dual_clip_fraction" not in metrics


def test_entropy_bonus_subtracts_the_aggregated_entropy_and_carries_its_gradient():
    plain, batch, context = module_and_inputs()
    bonus, _, _ = module_and_inputs(entropy_coef=0.1)
    loss_plain, _ = plain.policy_loss(batch, context)
    loss_bonus, metrics = bonus.policy_loss(batch, context)
    assert torch.allclose(loss_bonus, loss_plain - 0.1 * metrics["entropy"])  # token-mean aggregation
    loss_plain.backward()
    loss_bonus.backward()
    bonus_grads = [b - p for b, p in zip(grads(bonus), grads(plain))]
    # the difference is exactly the gradient of -0.1 x the mean entropy
    plain.policy.zero_grad()
    _, entropy = plain.sequence_logprobs(plain.policy, batch, entropy=True, entropy_grad=True)
    (-0.1 * masked_mean(entropy, batch.response_mask[:, 1:])).backward()
    assert all(torch.allclose(b, e, atol=1e-6) for b, e in zip(bonus_grads, grads(plain)))
    assert any(e.abs().sum() > 0 for e in grads(plain))


def test_without_a_bonus_the_entropy_is_logged_detached_on_the_first_mini_batch_only():
    module, batch, context = module_and_inputs()
    _, entropy = module.sequence_logprobs(module.policy, batch, entropy=True)
    assert not entropy.requires_grad
    module.first_minibatch = False
    assert "entropy" not in module.policy_loss(batch, context)[1]
    bonus, _, _ = module_and_inputs(entropy_coef=0.01)
    bonus.first_minibatch = False
    assert "entropy" in bonus.policy_loss(batch, context)[1]  # computed for the bonus anyway


def test_mask_truncated_leaves_full_budget_rows_without_a_stop_token_out_of_the_loss():
    module, batch, context = module_and_inputs(mask_truncated=True)
    assert module.truncated_rows(batch).tolist() == [True, False, False, True]
    assert context.trained_rows.tolist() == [False, True, True, False]
    loss, _ = module.policy_loss(batch, context)
    logp = module.sequence_logprobs(module.policy, batch)
    kept = batch.response_mask[:, 1:] * torch.tensor([0.0, 1.0, 1.0, 0.0])[:, None]
    expected, _ = ppo_clip_loss(logp, batch.rollout_logprobs[:, 1:], context.advantages, kept)
    assert torch.allclose(loss, expected)
    # the truncated rows still count in the group's advantages
    assert torch.allclose(context.advantages, group_advantages(batch.rewards, 4))
    perturbed = batch_of(*BATCH_ROWS)
    perturbed.rollout_logprobs[0] -= 3.0  # a truncated row: nothing changes
    assert torch.allclose(module.policy_loss(perturbed, context)[0], loss)


def test_overlong_penalty_shapes_the_rewards_before_the_group_advantages():
    torch.manual_seed(0)
    module = tiny_module(max_new_tokens=4, overlong_buffer=2, overlong_penalty=1.0)
    batch = batch_of([[5], [5, 6], [5, 6, 7], [5, 6, 7, 8]], [1.0, 1.0, 1.0, 1.0])
    context = module.prepare_batch(batch)
    # lengths 1, 2, 3, 4 against L_max 4 - buffer 2: penalties 0, 0, -0.5, -1
    shaped = torch.tensor([1.0, 1.0, 0.5, 0.0])
    assert torch.allclose(context.advantages, group_advantages(shaped, 4))
    assert batch.stats["train/overlong_penalty_mean"] == -0.375
    assert torch.equal(batch.rewards, torch.ones(4))  # the logged reward stays the task's


def test_ppo_puts_the_shaped_reward_on_the_last_token_and_masks_truncated_rows_in_the_value_loss():
    torch.manual_seed(0)
    module = tiny_module(
        PPOModule, max_new_tokens=4, overlong_buffer=2, whiten_advantages=False, mask_truncated=True
    )
    batch = batch_of([[5], [5, 6], [5, 6, 7], [5, 6, 7, 8]], [1.0, 1.0, 1.0, 1.0])
    context = module.prepare_batch(batch)
    last = batch.response_mask[:, 1:].cumsum(-1).argmax(-1)  # each row's last completion position
    # the critic starts at V = 0, so the return on the last token is the shaped reward
    returns = context.returns[torch.arange(4), last]
    assert torch.allclose(returns, torch.tensor([1.0, 1.0, 0.5, 0.0]))
    assert context.trained_rows.tolist() == [True, True, True, False]
    loss, metrics = module.minibatch_loss(batch, context)
    assert torch.isfinite(loss) and "vf_loss" in metrics


def test_sequence_mask_cap_weights_each_sequence_by_its_ratio_and_logs_the_masked_fraction():
    module, batch, _ = module_and_inputs(old_logprob="recompute", sequence_mask_cap=2.0)
    mask = batch.response_mask[:, 1:]
    trainer_logp = module.sequence_logprobs(module.policy, batch).detach()
    # sum_t (trainer - rollout) per sequence: 0, 0.2, -1.0 (ratio 1/e, below 1/2) and 0.3,
    # put on each row's first completion token (column 0: the prompt is one token)
    offsets = torch.zeros_like(trainer_logp)
    offsets[:, 0] = torch.tensor([0.0, 0.2, -1.0, 0.3])
    batch.rollout_logprobs[:, 1:] = (trainer_logp - offsets) * mask
    context = module.prepare_batch(batch)
    loss, metrics = module.policy_loss(batch, context)
    assert metrics["mismatch_masked_fraction"] == 0.25
    weights, rejected = sequence_masked_importance_weights(
        context.prox_logp, batch.rollout_logprobs[:, 1:], mask, 2.0
    )
    assert rejected.tolist() == [False, False, True, False]
    logp = module.sequence_logprobs(module.policy, batch)
    expected, _ = ppo_clip_loss(
        logp, context.prox_logp, context.advantages, mask, is_weights=weights, clip_ratio_c=3.0
    )
    assert torch.allclose(loss, expected)


def test_every_loss_option_defaults_to_todays_behaviour_but_the_dual_clip():
    parameters = inspect.signature(CausalLMModule.__init__).parameters
    defaults = {
        "loss": "ppo",
        "clip_ratio_c": 3.0,
        "ratio_level": "token",
        "cispo_cap": 5.0,
        "entropy_coef": 0.0,
        "sequence_mask_cap": None,
        "mask_truncated": False,
        "overlong_buffer": 0,
        "overlong_penalty": 1.0,
    }
    assert {k: parameters[k].default for k in defaults} == defaults
    hparams = tiny_module().hparams
    assert {k: hparams[k] for k in defaults} == defaults  # saved with checkpoints


RECIPE = ["--config", str(Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny.yaml")]


def test_the_cli_parses_the_loss_options_and_refuses_bad_ones_before_training(capsys):
    config = ParseOnlyCLI(
        args=[*RECIPE, "--model.init_args.loss=cispo", "--model.init_args.clip_ratio_c=null"], run=False
    ).config
    model = init_args(config.model)
    assert (model.loss, model.clip_ratio_c, model.ratio_level, model.overlong_buffer) == (
        "cispo",
        None,
        "token",
        0,
    )
    with pytest.raises(SystemExit):  # not a Literal value: the parser lists the allowed ones
        ParseOnlyCLI(args=[*RECIPE, "--model.init_args.loss=grpo"], run=False)
    with pytest.raises(SystemExit) as exit_info:  # exit 2, the last line naming the key
        run_cli([*RECIPE, "--model.init_args.ratio_level=sequence"], run=False)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "model.init_args.clip_ratio_c (dual-clip) is defined at ratio_level='token' only" in last
