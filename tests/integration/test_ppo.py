"""PPO (actor-critic, GAE) end to end on real Ray workers with a tiny real Llama: the on-policy pin, only
the policy reaching the workers, learning on ``digit_successor``, the TensorBoard tags and bad arguments."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.builders import fit_tiny, tiny_module
from unirl_lightning.cli.curves import read_scalars
from unirl_lightning.modules import PPOModule
from unirl_lightning.strategy import AsyncRolloutStrategy

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "ppo_tiny.yaml"
STEPS = 80
REQUIRED_TAGS = [
    "rollout/reward_mean",
    "train/loss",
    "train/pg_loss",
    "train/vf_loss",
    "train/value_mean",
    "train/ratio_mean",
    "train/clip_fraction",
    "train/logp_diff_abs",
    "train/explained_variance",
    "perf/train_time_s",
    "sync/bytes",
]


def tiny_ppo(**overrides) -> PPOModule:
    return tiny_module(PPOModule, **{"num_generations": 8, **overrides})


def nbytes(model: torch.nn.Module) -> int:
    return sum(v.numel() * v.element_size() for v in model.state_dict().values())


@pytest.fixture(scope="module")
def on_policy_run(tmp_path_factory, ray_local):
    """One synchronous run (max_staleness=0) long enough to learn; every test below reads it."""
    strategy = AsyncRolloutStrategy(max_staleness=0, max_inflight=1)
    module = tiny_ppo()
    critic_init = {k: v.clone() for k, v in module.critic.state_dict().items()}
    trainer, module, recorder = fit_tiny(
        tmp_path_factory.mktemp("ppo"), max_steps=STEPS, strategy=strategy, module=module, batch_size=16
    )
    yield trainer, module, recorder, critic_init
    strategy.shutdown()


def test_on_policy_ratio_is_one_and_logprobs_match_at_max_staleness_0(on_policy_run):
    _, _, recorder, _ = on_policy_run
    assert len(recorder.steps) == STEPS
    for step in recorder.steps:
        assert set(step["row_versions"]) == {step["version"]}, (
            "max_staleness=0 trained a sample across a sync"
        )
        assert abs(step["metrics"]["train/ratio_mean"] - 1.0) < 1e-3
        assert step["metrics"]["train/logp_diff_abs"] < 1e-4


def test_only_policy_weights_reach_the_workers(on_policy_run):
    trainer, module, _, _ = on_policy_run
    strategy = trainer.strategy
    policy_state = {k: v.detach().cpu() for k, v in module.policy.state_dict().items()}
    for worker_state in strategy.runtime.workers.call("state_dict"):
        assert worker_state.keys() == policy_state.keys()
        for name, tensor in policy_state.items():
            assert torch.equal(worker_state[name], tensor), f"worker weight {name} differs from the policy's"
    assert strategy.last_sync["sync/bytes"] == nbytes(module.policy)
    assert strategy.last_sync["sync/bytes"] < nbytes(module.policy) + nbytes(module.critic)
    policy_params = {id(p) for p in module.policy.parameters()}
    assert not any(id(p) in policy_params for p in module.critic.parameters()), "the critic is in the policy"


def test_critic_is_trained_by_the_optimizer_and_checkpointed(on_policy_run):
    trainer, module, _, critic_init = on_policy_run
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert all(id(p) in optimized for p in module.critic.parameters())
    assert all(id(p) in optimized for p in module.policy.parameters())
    assert trainer.optimizers[0].param_groups[1]["lr"] == module.critic_lr
    changed = [k for k, v in module.critic.state_dict().items() if not torch.equal(v, critic_init[k])]
    assert "value_head.weight" in changed and any(k.startswith("backbone.") for k in changed)
    assert any(k.startswith("critic.value_head") for k in module.state_dict())


def test_ppo_learns_digit_successor(on_policy_run):
    _, _, recorder, _ = on_policy_run
    rewards = [s["metrics"]["rollout/reward_mean"] for s in recorder.steps]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"reward_mean: first 10 steps {first:.3f} -> last 10 steps {last:.3f}")
    assert last > first + 0.3, f"no learning: reward {first:.3f} -> {last:.3f}"


def test_tensorboard_has_every_ppo_tag(on_policy_run):
    trainer, _, _, _ = on_policy_run
    scalars = read_scalars(trainer.logger.log_dir)
    missing = [t for t in REQUIRED_TAGS if t not in scalars]
    assert not missing, f"missing TensorBoard tags: {missing}"
    assert len(scalars["train/vf_loss"]) == STEPS


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("gamma", 1.5, r"\[0, 1\]"),
        ("gamma", -0.1, r"\[0, 1\]"),
        ("lam", 2.0, r"\[0, 1\]"),
        ("vf_coef", -0.5, ">= 0"),
        ("value_clip", 0.0, "> 0"),
        ("critic_lr", -1e-3, "> 0"),
        ("advantage", "grpo", "GAE"),
    ],
)
def test_bad_arguments_raise_naming_the_argument_and_value(key, value, allowed):
    with pytest.raises(ValueError, match=allowed) as exc:
        PPOModule(**{key: value})
    assert key in str(exc.value) and repr(value) in str(exc.value)


def test_recipe_parses_into_a_ppo_module(tmp_path):
    from unirl_lightning.cli.app import run_cli

    cli = run_cli(["--config", str(RECIPE), f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert type(cli.model) is PPOModule
    assert (cli.model.gamma, cli.model.lam, cli.model.vf_coef) == (1.0, 0.95, 0.1)
    assert "advantage" not in cli.model.hparams
