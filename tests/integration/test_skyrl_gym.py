"""A skyrl-gym ``BaseTextEnv`` (``tests/integration/skyrl_envs.py``, written as SkyRL's docs write one)
runs as an agentic environment: directly through the adapter, and through ``AgenticGRPOModule`` on the
tiny model with Ray workers, its episodes, turns and rewards logged like the built-in environments'."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("skyrl_gym")

from unirl_lightning.cli.app import run_cli  # noqa: E402
from unirl_lightning.cli.curves import read_scalars  # noqa: E402
from unirl_lightning.envs import SkyRLGymEnv  # noqa: E402

RECIPE = str(Path(__file__).resolve().parents[2] / "examples" / "agentic_calculator_tiny.yaml")
ENV = "tests.integration.skyrl_envs:AnswerEnv"


def test_the_adapter_plays_a_skyrl_episode_with_its_rewards_turns_and_limit():
    env = SkyRLGymEnv(ENV, env_config={"partial": 0.25}, max_turns=3)
    record = {"prompt": "7*7-1?", "answer": "48"}
    assert env.reset(record) == [{"role": "user", "content": "7*7-1?"}]
    assert (
        SkyRLGymEnv(ENV, chat=False).reset(record) == "7*7-1?"
    )  # a raw prompt for a model without a template
    first = env.step("47")
    assert (first.observation, first.reward, first.done) == ("?", 0.25, False)
    last = env.step("so 48")
    assert (last.reward, last.done, env.total_reward) == (1.0, True, 1.25)
    env.reset(record)  # the turn limit is the adapter's (the base class ends the episode there)
    results = [env.step("x") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True] and results[-1].info["truncated"] is False


def test_a_wrong_class_is_refused_naming_the_path():
    env = SkyRLGymEnv("unirl_lightning.envs:CalculatorEnv")
    with pytest.raises(TypeError, match="not a skyrl-gym BaseTextEnv subclass"):
        env.reset({"prompt": "1?", "answer": "1"})


@pytest.mark.slow
def test_agentic_grpo_trains_on_a_skyrl_environment(tmp_path, monkeypatch, ray_local):
    monkeypatch.chdir(tmp_path)
    override = tmp_path / "skyrl.yaml"
    env = {
        "class_path": "unirl_lightning.envs.SkyRLGymEnv",
        "init_args": {"env_class": ENV, "max_turns": 2, "chat": False},
    }
    override.write_text(yaml.safe_dump({"model": {"init_args": {"env": env}}}))
    cli = run_cli(
        [
            "fit",
            "--config",
            RECIPE,
            "--config",
            str(override),
            "--trainer.max_steps=4",
            "--trainer.enable_progress_bar=false",
        ]
    )
    cli.trainer.strategy.shutdown()
    scalars = read_scalars(Path(cli.trainer.logger.log_dir))
    turns = [v for _, v in scalars["agentic/turns_mean"]]
    rewards = [v for _, v in scalars["rollout/reward_mean"]]
    print("steps", len(rewards), "turns_mean", turns, "reward_mean", rewards)
    assert len(rewards) == 4 and all(1.0 <= t <= 2.0 for t in turns)  # every episode played 1 or 2 turns
    assert all(0.0 <= r <= 1.2 for r in rewards)  # a return is at most partial + 1
