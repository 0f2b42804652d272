"""Reward contract and the generic rewards (the checked entry point :func:`score_batch` is in
:mod:`unirl_lightning.rewards.scoring`, function wrappers in :mod:`unirl_lightning.rewards.callable`).

Contract: a reward is a picklable object (it is shipped to Ray worker processes) with a
``name: str`` and ``__call__(completions: list[str], records: list[dict]) -> list[float]``
that scores a batch; ``records[i]`` is the prompt record (``{"prompt", "answer", ...}``) that
``completions[i]`` answers. Callers (rollout workers, the eval callback) never call a reward
directly: they call :func:`score_batch`, which guarantees one finite float per completion or
raises :class:`RewardError` naming the reward and the batch's first prompt.

Subclasses of :class:`Reward` either implement ``score(completion, record) -> float`` (the
default ``__call__`` loops over the batch) or override ``__call__`` to score a batch at once.

Plain functions (``reward: pkg.mod:fn`` or ``CallableReward(fn)``) are called by one rule, read off
their signature (see :class:`CallableReward`):

* first parameter named ``completions``: TRL's way, once per batch,
  ``fn(completions, prompts=[...], <every record key>=[...], completion_ids=..., finish_reasons=...)``
  returning ``list[float | None]``; ``None`` is "no opinion";
* anything else: per sample, ``fn(completion, record) -> float``;
* ``async def`` functions are awaited in the worker (a batch's per-sample calls concurrently).

Several rewards: :class:`CombinedReward` (weighted sum; ``None`` scores are left out, a sample
every component says ``None`` to scores 0). :func:`score_parts` also returns each component's
scores, which the rollout loop logs as ``rollout/reward/<name>_mean``.

Example::

    >>> from unirl_lightning.rewards import CombinedReward, ExactMatchReward, FormatReward, score_batch
    >>> reward = CombinedReward([ExactMatchReward(), FormatReward(r"\\d")], weights=[1.0, 0.1])
    >>> score_batch(reward, ["7", "x"], [{"prompt": "6+1=", "answer": "7"}] * 2)
    [1.1, 0.0]
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["ExactMatchReward", "FormatReward", "Reward", "RewardError"]


class RewardError(RuntimeError):
    """A reward raised, returned the wrong number of scores, or returned a non-finite score."""


class Reward:
    """Base class: a named, picklable batch scorer.

    Subclasses set ``name`` and implement :meth:`score` (per sample) or override ``__call__``.
    """

    name: str = "reward"

    def __call__(self, completions: list[str], records: list[dict]) -> list[float]:
        return [float(self.score(completion, record)) for completion, record in zip(completions, records)]

    def score(self, completion: str, record: dict) -> float:
        raise NotImplementedError(f"{type(self).__name__} must implement score() or override __call__().")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _record_field(record: dict, key: str, reward: str) -> Any:
    try:
        return record[key]
    except KeyError:
        raise KeyError(
            f"Reward {reward!r} needs record key {key!r}, but the record has keys {sorted(record)}."
        ) from None


class ExactMatchReward(Reward):
    """1.0 when the completion equals ``str(record[answer_key])``, else 0.0.

    Args:
        answer_key: Record key holding the reference answer.
        strip: Strip surrounding whitespace from both sides before comparing.

    Example::

        >>> ExactMatchReward()(["7 ", "8"], [{"answer": "7"}, {"answer": "7"}])
        [1.0, 0.0]
    """

    name = "exact_match"

    def __init__(self, answer_key: str = "answer", strip: bool = True) -> None:
        self.answer_key = answer_key
        self.strip = strip

    def score(self, completion: str, record: dict) -> float:
        answer = str(_record_field(record, self.answer_key, self.name))
        if self.strip:
            completion, answer = completion.strip(), answer.strip()
        return 1.0 if completion == answer else 0.0


class FormatReward(Reward):
    """``score`` when the completion matches the regex ``pattern``, else 0.0.

    The match is *partial* (``re.search``: the pattern may match anywhere) unless
    ``fullmatch=True`` (``re.fullmatch``: the whole completion must match). Use inline flags such
    as ``(?s)`` for multi-line completions.

    Args:
        pattern: Python regular expression.
        score: Reward for a match.
        fullmatch: Require the whole completion to match instead of any substring.

    Example::

        >>> FormatReward(r"<answer>\\d+</answer>")(["so <answer>42</answer>", "42"], [{}, {}])
        [1.0, 0.0]
    """

    name = "format"

    def __init__(self, pattern: str, score: float = 1.0, fullmatch: bool = False) -> None:
        try:
            self._regex = re.compile(pattern)
        except re.error as err:
            raise ValueError(
                f"FormatReward pattern={pattern!r} is not a valid regular expression: {err}."
            ) from err
        self.pattern = pattern
        self.match_score = float(score)
        self.fullmatch = fullmatch

    def score(self, completion: str, record: dict) -> float:
        matcher = self._regex.fullmatch if self.fullmatch else self._regex.search
        return self.match_score if matcher(completion) else 0.0
