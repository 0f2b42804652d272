"""Rewards: picklable batch scorers ``reward(completions, records) -> list[float]``, and plain
functions called per sample (``fn(completion, record)``) or TRL's way (``fn(completions, **columns)``).

Call them through :func:`score_batch`, which checks the result and wraps failures in
:class:`RewardError`. See :mod:`unirl_lightning.rewards.base` for the contract.
"""

from unirl_lightning.rewards.base import (
    CallableReward,
    CombinedReward,
    ExactMatchReward,
    FormatReward,
    Reward,
    RewardError,
    import_callable,
    is_batched_function,
    part_name,
    resolve_reward,
    reward_name,
    score_batch,
    score_parts,
)
from unirl_lightning.rewards.math import MathVerifyReward

__all__ = [
    "CallableReward",
    "CombinedReward",
    "ExactMatchReward",
    "FormatReward",
    "MathVerifyReward",
    "Reward",
    "RewardError",
    "import_callable",
    "is_batched_function",
    "part_name",
    "resolve_reward",
    "reward_name",
    "score_batch",
    "score_parts",
]
