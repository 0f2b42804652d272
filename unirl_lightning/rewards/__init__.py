"""Rewards: picklable batch scorers ``reward(completions, records) -> list[float]``, and plain
functions called per sample (``fn(completion, record)``) or TRL's way (``fn(completions, **columns)``).
Beyond the rule rewards: :class:`CodeExecutionReward` (a completion's code against its record's
tests, in a bubblewrap sandbox), :class:`RemoteReward` (an HTTP scoring service) and
:class:`ReasoningGymReward` (reasoning-gym's own verifiers).

Call them through :func:`score_batch`, which checks the result and wraps failures in
:class:`RewardError`. See :mod:`unirl_lightning.rewards.base` for the contract.
"""

from unirl_lightning.core.imports import import_callable
from unirl_lightning.rewards.base import ExactMatchReward, FormatReward, Reward, RewardError
from unirl_lightning.rewards.callable import CallableReward, is_batched_function, resolve_reward
from unirl_lightning.rewards.code import CodeExecutionReward
from unirl_lightning.rewards.math import MathVerifyReward
from unirl_lightning.rewards.reasoning_gym import ReasoningGymReward
from unirl_lightning.rewards.remote import RemoteReward
from unirl_lightning.rewards.reward_model import RewardModelReward, build_tiny_reward_model
from unirl_lightning.rewards.scoring import CombinedReward, part_name, reward_name, score_batch, score_parts

__all__ = [
    "CallableReward",
    "CodeExecutionReward",
    "CombinedReward",
    "ExactMatchReward",
    "FormatReward",
    "MathVerifyReward",
    "ReasoningGymReward",
    "RemoteReward",
    "Reward",
    "RewardError",
    "RewardModelReward",
    "build_tiny_reward_model",
    "import_callable",
    "is_batched_function",
    "part_name",
    "resolve_reward",
    "reward_name",
    "score_batch",
    "score_parts",
]
