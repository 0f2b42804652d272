"""Environments written for SkyRL run here: :class:`SkyRLGymEnv` adapts any skyrl-gym ``BaseTextEnv``
(chat-message observations, string actions, a reward and ``done`` per step) to
:class:`~unirl_lightning.envs.base.Environment`, so ``AgenticGRPOModule`` trains on it with the turn
limit, the tail policy and the oldest-turn staleness bound of the built-in environments.

How an episode maps:

* ``reset(record)`` builds the SkyRL environment the way SkyRL's trainer does,
  ``EnvClass(env_config=OmegaConf.create(env_config), extras={"reward_spec": {"method": "rule",
  "ground_truth": record[ground_truth_key]}, "max_turns": max_turns, **record.get("extras", {})})``, and
  returns what its ``init(prompt)`` returns (chat messages; the prompt is the record's ``messages``, or
  its ``prompt`` as one user message; ``chat=False``: their contents as one raw prompt);
* ``step(text)`` returns the SkyRL step's reward and ``done``, and, while not done, its observation
  messages' contents joined by newlines as the next user turn;
* ``max_turns`` here is the episode's limit (the base class ends the episode there), also handed to
  the SkyRL environment as ``extras["max_turns"]``.

skyrl-gym (and its ``omegaconf``) is imported only when an episode starts: ``pip install skyrl-gym``.
"""

from __future__ import annotations

from typing import Any

from unirl_lightning.core.imports import import_object
from unirl_lightning.envs.base import Environment, Observation, StepResult

__all__ = ["SkyRLGymEnv"]


class SkyRLGymEnv(Environment):
    """A skyrl-gym ``BaseTextEnv`` as an agentic environment.

    Args:
        env_class: import path of the ``BaseTextEnv`` subclass (``"pkg.mod:Class"`` or a file path
            ``"envs.py:Class"``).
        env_config: the environment's ``env_config`` (a plain dict, turned into an ``OmegaConf`` config).
        max_turns: model turns per episode.
        ground_truth_key: the record key handed over as ``extras["reward_spec"]["ground_truth"]``.
        chat: return ``init``'s chat messages as they are (rendered with the policy's chat template);
            False: their contents joined by newlines, a raw prompt for a model without a chat template.

    Example::

        env: {class_path: unirl_lightning.envs.SkyRLGymEnv, init_args: {env_class: my_envs:MultiplyEnv, max_turns: 3}}
    """

    def __init__(
        self,
        env_class: str,
        env_config: dict[str, Any] | None = None,
        max_turns: int = 4,
        ground_truth_key: str = "answer",
        chat: bool = True,
    ) -> None:
        super().__init__(max_turns)
        if not isinstance(env_class, str) or not env_class:
            raise ValueError(f"SkyRLGymEnv env_class={env_class!r}: expected an import path 'pkg.mod:Class'")
        self.env_class = env_class
        self.env_config = dict(env_config or {})
        self.ground_truth_key = ground_truth_key
        self.chat = bool(chat)
        self._env: Any = None

    def __getstate__(self) -> dict[str, Any]:  # a live SkyRL environment never crosses processes
        return {**self.__dict__, "_env": None}

    def on_reset(self, record: dict[str, Any]) -> Observation:
        try:
            from omegaconf import OmegaConf
            from skyrl_gym.envs.base_text_env import BaseTextEnv
        except ImportError as exc:
            raise ImportError("SkyRLGymEnv needs skyrl-gym: pip install skyrl-gym") from exc
        cls = import_object(self.env_class, "env_class", kind="class")
        if not (isinstance(cls, type) and issubclass(cls, BaseTextEnv)):
            raise TypeError(
                f"SkyRLGymEnv env_class={self.env_class!r} is not a skyrl-gym BaseTextEnv subclass"
            )
        extras = {
            "reward_spec": {"method": "rule", "ground_truth": record.get(self.ground_truth_key)},
            "max_turns": self.max_turns,
            **(record.get("extras") or {}),
        }
        self._env = cls(env_config=OmegaConf.create(self.env_config), extras=extras)
        prompt = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
        observations, _ = self._env.init(prompt)
        messages = [dict(message) for message in observations]
        return messages if self.chat else "\n".join(str(m.get("content", "")) for m in messages)

    def on_step(self, assistant_text: str) -> StepResult:
        out = self._env.step(assistant_text)
        done = bool(out["done"])
        if done:
            self._env.close()
            return StepResult(None, float(out["reward"]), True)
        observation = "\n".join(str(m.get("content", "")) for m in out.get("observations") or [])
        return StepResult(observation, float(out["reward"]), False)
