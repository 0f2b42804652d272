"""The one checked entry point of every reward call (:func:`score_batch`, :func:`score_parts`) and
:class:`CombinedReward`: one finite float per completion, or a :class:`RewardError` naming the reward
and the batch's first prompt.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from unirl_lightning.rewards.base import Reward, RewardError
from unirl_lightning.rewards.callable import _EXTRAS, CallableFunction, _signature, resolve_reward

__all__ = [
    "CombinedReward",
    "part_name",
    "reward_name",
    "reward_timeouts",
    "score_batch",
    "score_parts",
]

_PROMPT_PREVIEW_CHARS = 200


def reward_name(reward: Any) -> str:
    """The name used for ``reward`` in logs and errors."""
    if isinstance(reward, str):
        return reward
    name = getattr(reward, "name", None)
    if isinstance(name, str) and name:
        return name
    return getattr(reward, "__name__", type(reward).__name__)


def reward_timeouts(reward: Any) -> int:
    """The checks ``reward`` has given up on so far (a reward's ``timeouts`` counter, such as
    :class:`~unirl_lightning.rewards.MathVerifyReward`'s; a combined reward's summed over its parts;
    0 for a reward that counts none)."""
    parts = getattr(reward, "rewards", None)
    if isinstance(parts, list):
        return sum(reward_timeouts(part) for part in parts)
    count = getattr(reward, "timeouts", 0)
    return count if isinstance(count, int) else 0


def part_name(reward: Any) -> str:
    """The name of ``reward`` in the per-reward figures (``rollout/reward/<name>_mean``): a
    function's own name (the last part of its import path), else :func:`reward_name`."""
    if isinstance(reward, CallableFunction) and not getattr(reward, "_named", False):
        if isinstance(reward.fn, str):
            return re.split(r"[:.]", reward.fn)[-1]
        return getattr(reward.fn, "__name__", type(reward.fn).__name__)
    return reward_name(reward)


def _prompt_preview(records: Sequence[dict]) -> str:
    if not records:
        return "<empty batch>"
    first = records[0]
    prompt = str(first.get("prompt", "<no 'prompt' key>")) if isinstance(first, dict) else repr(first)
    if len(prompt) > _PROMPT_PREVIEW_CHARS:
        prompt = prompt[:_PROMPT_PREVIEW_CHARS] + "..."
    return repr(prompt)


def score_batch(
    reward: Reward | str | Callable, completions: list[str], records: list[dict], **extras: Any
) -> list[float]:
    """Score a batch with ``reward`` and check the result: one finite float per completion.

    ``reward`` may be a :class:`Reward`, any callable ``(completions, records) -> list[float]``
    with an optional ``name``, or an import path of a function (wrapped in :class:`CallableReward`,
    which calls it per sample or TRL's way, batched: see there). ``extras`` (``completion_ids``,
    ``finish_reasons``: one entry per completion) reach the rewards that take them. A ``None``
    score (a batched function's "no opinion") counts as 0.

    Raises:
        ValueError: ``completions`` and ``records`` differ in length.
        RewardError: the reward raised (chained as ``__cause__``), returned a different number of
            scores than completions, or returned a value that is not a finite number. The message
            names the reward and the first prompt of the batch.
    """
    return score_parts(reward, completions, records, **extras)[0]


def score_parts(
    reward: Reward | str | Callable, completions: list[str], records: list[dict], **extras: Any
) -> tuple[list[float], dict[str, list[float | None]]]:
    """:func:`score_batch`, and each reward's own scores by :func:`part_name`.

    For a :class:`CombinedReward` the parts are its components' unweighted scores (``None`` where a
    component had no opinion; a repeated name gets ``_2``, ``_3``, ...); for any other reward the
    one part is the reward itself. The totals are the weighted sums of the non-``None`` parts.

    Example::

        >>> from unirl_lightning.rewards import ExactMatchReward, FormatReward
        >>> reward = CombinedReward([ExactMatchReward(), FormatReward(r"\\d")], weights=[1.0, 0.5])
        >>> score_parts(reward, ["7", "x"], [{"prompt": "6+1=", "answer": "7"}] * 2)
        ([1.5, 0.0], {'exact_match': [1.0, 0.0], 'format': [1.0, 0.0]})
    """
    reward = resolve_reward(reward)
    if len(completions) != len(records):
        raise ValueError(
            f"score_batch for reward {reward_name(reward)!r} got {len(completions)} completions but "
            f"{len(records)} records; expected one record per completion."
        )
    if isinstance(reward, CombinedReward):
        components, weights = reward.rewards, reward.weights
    else:
        components, weights = [reward], [1.0]
    parts: dict[str, list[float | None]] = {}
    totals = [0.0] * len(completions)
    for component, weight in zip(components, weights):
        values = _checked_scores(component, completions, records, extras)
        name = part_name(component)
        unique, count = name, 1
        while unique in parts:
            count += 1
            unique = f"{name}_{count}"
        parts[unique] = values
        for index, value in enumerate(values):
            if value is not None:
                totals[index] += weight * value
    return totals, parts


def _accepts_extras(reward: Any) -> bool:
    signature = _signature(reward)  # of a callable object: its __call__, without self
    if signature is None:
        return False
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD or p.name in _EXTRAS for p in signature.parameters.values()
    )


def _checked_scores(
    reward: Any, completions: list[str], records: list[dict], extras: dict[str, Any]
) -> list[float | None]:
    """One reward's scores, checked: a finite float per completion (``None`` where it may say so)."""
    name = reward_name(reward)
    where = f"reward {name!r} on the batch whose first prompt is {_prompt_preview(records)}"
    passed = {key: value for key, value in extras.items() if value is not None}
    try:
        if passed and _accepts_extras(reward):
            scores = reward(completions, records, **passed)
        else:
            scores = reward(completions, records)
    except RewardError:
        raise
    except Exception as err:
        raise RewardError(f"{where} raised {type(err).__name__}: {err}") from err
    try:
        scores = list(scores)
    except TypeError as err:
        raise RewardError(
            f"{where} returned {scores!r}; expected a list of {len(completions)} floats."
        ) from err
    if len(scores) != len(completions):
        raise RewardError(
            f"{where} returned {len(scores)} scores; expected {len(completions)} (one per completion)."
        )
    allows_none = bool(getattr(reward, "allows_none", False))
    checked: list[float | None] = []
    for index, value in enumerate(scores):
        if value is None and allows_none:
            checked.append(None)
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            expected = "a finite float or None" if allows_none else "a finite float"
            raise RewardError(f"{where} returned score {value!r} at index {index}; expected {expected}.")
        checked.append(number)
    return checked


class CombinedReward(Reward):
    """Weighted sum of several rewards: ``sum(w_k * reward_k(completions, records))``.

    Each component is scored and checked on its own, so a failing component raises a
    :class:`RewardError` naming that component. A ``None`` score (a TRL-style function's "no
    opinion") is left out of the sum; a sample that every component says ``None`` to scores 0.
    Each component is also logged on its own (``rollout/reward/<name>_mean``, ``eval/reward/...``;
    the name is the function's ``__name__`` or the reward's ``name``), unweighted.

    Args:
        rewards: Components: :class:`Reward` objects or import paths of functions (per-sample or
            TRL-style, see :class:`CallableReward`).
        weights: One weight per component; defaults to 1.0 each.

    Example::

        >>> from unirl_lightning.rewards import ExactMatchReward, FormatReward
        >>> CombinedReward([ExactMatchReward(), FormatReward(r"^\\d$")], weights=[1.0, 0.5])(
        ...     ["7", "77"], [{"answer": "7"}, {"answer": "7"}])
        [1.5, 0.0]
    """

    def __init__(self, rewards: list[Reward | str], weights: list[float] | None = None) -> None:
        if not rewards:
            raise ValueError("CombinedReward rewards=[] is empty; expected at least one reward.")
        self.rewards = [resolve_reward(reward) for reward in rewards]
        if weights is None:
            weights = [1.0] * len(self.rewards)
        if len(weights) != len(self.rewards):
            raise ValueError(
                f"CombinedReward weights={weights!r} has {len(weights)} entries; "
                f"expected {len(self.rewards)} (one per reward)."
            )
        if not all(math.isfinite(float(weight)) for weight in weights):
            raise ValueError(f"CombinedReward weights={weights!r} must all be finite numbers.")
        self.weights = [float(weight) for weight in weights]
        self.name = "combined(" + ",".join(reward_name(reward) for reward in self.rewards) + ")"

    def __call__(self, completions: list[str], records: list[dict], **extras: Any) -> list[float]:
        return score_parts(self, completions, records, **extras)[0]
