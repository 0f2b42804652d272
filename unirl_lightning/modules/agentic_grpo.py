"""AgenticGRPOModule: GRPO on multi-turn episodes with an environment (tools, games), in Lightning.

What it adds to :class:`~unirl_lightning.modules.grpo.GRPOModule` is only what is agentic: the
environment (a class path from YAML, validated by
:func:`~unirl_lightning.envs.resolve_environment`), the turn limit, the tail policy and what an
environment crash does. Its :meth:`rollout_spec` carries them as an
:class:`~unirl_lightning.rollout.agentic_loop.AgenticSpec`, so the strategy installs the
:class:`~unirl_lightning.rollout.agentic_loop.AgenticRolloutLoop` and the workers play episodes
turn by turn (:mod:`unirl_lightning.envs.coordinator`).

Training is GRPOModule's, unchanged: one episode is one row (its initial observation as the
prompt, every later token as the completion), the group is the ``num_generations`` episodes of one
prompt record, the reward is the episode's return, and the loss is taken only where
``response_mask`` is 1: the model's own tokens (``Rollout.loss_mask``), never the tool or
environment tokens between turns, whose behaviour log-probs are 0. The trainer scores exactly the
token ids the engine sampled. Staleness is counted from the version at which a group *completed*.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from jsonargparse.typing import PositiveInt

from unirl_lightning.checks import require_choice
from unirl_lightning.envs import EnvSpec, OnEnvError, resolve_environment
from unirl_lightning.modules.base import RolloutSpec
from unirl_lightning.modules.grpo import GRPOModule
from unirl_lightning.rollout.agentic import TailPolicy
from unirl_lightning.rollout.agentic_loop import AgenticSpec


class AgenticGRPOModule(GRPOModule):
    """GRPO over multi-turn episodes; only model tokens are trained.

    Args:
        env: the environment: a class path ``"pkg.mod:EnvClass"``, or ``{"class_path": ...,
            "init_args": {...}}`` (YAML), or an :class:`~unirl_lightning.envs.EnvSpec`. The
            environment's reward is the reward: there is no ``reward`` argument.
        max_turns: model turns per episode; overrides the environment's ``max_turns`` init
            argument when given.
        tail_policy: what a weight sync does to groups whose episodes it interrupted: ``"carry"``
            (they resume after the sync and finish later) or ``"drop"`` (discarded, counted in
            ``agentic/dropped``).
        on_env_error: an environment that raises: ``"raise"`` stops the run with an
            :class:`~unirl_lightning.envs.EnvStepError` naming the environment and the record;
            ``"drop"`` fails that episode's group (counted in ``agentic/env_errors``) and goes on.
        **kwargs: every :class:`~unirl_lightning.modules.grpo.GRPOModule` argument but ``reward``
            (``policy``, ``num_generations``, sampling: ``max_new_tokens`` is per model turn,
            AdamW, clipping, KL, ``ppo_epochs``/``mini_batches``, ...).

    Example::

        module = AgenticGRPOModule(
            env={"class_path": "unirl_lightning.envs.GuessingGameEnv", "init_args": {"syntax": "compact"}},
            max_turns=4, policy=TinyCausalLM(), num_generations=8, max_new_tokens=1, lr=1e-3)
    """

    def __init__(
        self,
        env: str | dict[str, Any] | EnvSpec,
        max_turns: PositiveInt | None = None,
        tail_policy: TailPolicy = "carry",
        on_env_error: OnEnvError = "raise",
        **kwargs: Any,
    ) -> None:
        if kwargs.get("reward") is not None:
            raise ValueError(
                "AgenticGRPOModule takes no reward: the environment scores each episode (its step rewards "
                f"summed); configure the environment's reward instead, got reward={kwargs['reward']!r}"
            )
        super().__init__(**kwargs)
        self.reward = None  # the environment's return is the reward
        spec = resolve_environment(env, key="model.env")
        if max_turns is not None:
            spec = resolve_environment(
                EnvSpec(spec.class_path, {**spec.init_args, "max_turns": int(max_turns)}), key="model.env"
            )
        self.env = spec
        self.max_turns = spec.build().max_turns
        self.tail_policy = require_choice("tail_policy", tail_policy, TailPolicy)
        self.on_env_error = require_choice("on_env_error", on_env_error, OnEnvError)

    def rollout_spec(self) -> RolloutSpec:
        agentic = AgenticSpec(env=self.env, tail_policy=self.tail_policy, on_env_error=self.on_env_error)
        return replace(super().rollout_spec(), reward=None, agentic=agentic)

    def eval_sampling(self, temperature: float) -> Any:
        """Held-out episodes (``RolloutEvalCallback``) sample like training (per-turn budget, stop
        strings) at ``temperature``."""
        return replace(self.sampling, temperature=temperature)
