"""An environment written for SkyRL, the way skyrl-gym's documentation writes one (``BaseTextEnv``,
``env_config`` and ``extras`` in the constructor, ``step`` returning ``BaseTextEnvStepOutput``); the
tests run it here through :class:`~unirl_lightning.envs.SkyRLGymEnv`."""

from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class AnswerEnv(BaseTextEnv):
    """Answer the question; a wrong answer gets "?" back and another try, until ``max_turns``."""

    def __init__(self, env_config: DictConfig, extras: dict[str, Any] = {}):  # noqa: B006 - SkyRL's signature
        super().__init__()
        self.ground_truth = str(extras["reward_spec"]["ground_truth"])
        self.max_turns = extras.get("max_turns", 3)
        self.partial = float(env_config.get("partial", 0.1))

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        numbers = re.findall(r"-?\d+", action)
        if numbers and numbers[-1] == self.ground_truth:
            return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={})
        reward = self.partial if numbers else 0.0  # some credit for answering with a number
        done = self.turns >= self.max_turns
        return BaseTextEnvStepOutput(
            observations=[] if done else [{"role": "user", "content": "?"}],
            reward=reward,
            done=done,
            metadata={},
        )
