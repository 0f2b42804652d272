"""Environments for agentic multi-turn RL, run inside the rollout workers.

Contract (:mod:`unirl_lightning.envs.base`): an :class:`Environment` is a picklable, pure-Python
object running one episode at a time: ``reset(record, seed) -> observation``, then
``step(assistant_text) -> StepResult(observation, reward, done, info)`` until ``done``, with a
``max_turns`` limit. Coordinators call them through :func:`safe_reset` / :func:`safe_step`, which
report a crashing environment as :class:`EnvStepError`. A user's environment plugs in by class path
(:func:`resolve_environment` -> :class:`EnvSpec`, one ``build()`` per episode).

Coordinator (:mod:`unirl_lightning.envs.coordinator`): :class:`EpisodeCoordinator` plays many
episodes at once inside a rollout worker, one generation call per turn for all of them, and keeps
every turn's token ids, behaviour log-probs and a loss mask (1 on model tokens, 0 on observations).

Built-ins: :class:`CalculatorEnv` (a safe arithmetic tool, math-verify on the final answer) and
:class:`GuessingGameEnv` (higher/lower), each with a ``compact`` syntax for the tiny
character-level model and a record generator with disjoint train / held-out splits.

This package imports only the standard library and :mod:`unirl_lightning.rewards` (no torch, no ray).
"""

from unirl_lightning.envs.base import (
    Environment,
    EnvStepError,
    Episode,
    EpisodeStateError,
    Observation,
    Split,
    StepResult,
    run_episode,
    safe_reset,
    safe_step,
)
from unirl_lightning.envs.calculator import (
    CalculatorEnv,
    CalculatorError,
    calculator_records,
    digit_credit,
    parse_calculator_turn,
    safe_eval,
)
from unirl_lightning.envs.coordinator import EpisodeCoordinator, EpisodeRequest, OnEnvError
from unirl_lightning.envs.guessing import GuessingGameEnv, guessing_records, parse_guess
from unirl_lightning.envs.skyrl import SkyRLGymEnv
from unirl_lightning.envs.spec import EnvSpec, import_environment_class, resolve_environment

__all__ = [
    "CalculatorEnv",
    "CalculatorError",
    "EnvSpec",
    "EnvStepError",
    "Environment",
    "Episode",
    "EpisodeCoordinator",
    "EpisodeRequest",
    "EpisodeStateError",
    "GuessingGameEnv",
    "Observation",
    "OnEnvError",
    "SkyRLGymEnv",
    "Split",
    "StepResult",
    "calculator_records",
    "digit_credit",
    "guessing_records",
    "import_environment_class",
    "parse_calculator_turn",
    "parse_guess",
    "resolve_environment",
    "run_episode",
    "safe_eval",
    "safe_reset",
    "safe_step",
]
