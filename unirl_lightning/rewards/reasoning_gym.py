"""reasoning-gym's own verifiers as a reward: the answer is extracted from the completion and scored by
the ``score_answer`` of the dataset the record came from (records of ``data.train:
"reasoning_gym:<name>"`` keep reasoning-gym's entry, :mod:`unirl_lightning.data.reasoning_gym`)."""

from __future__ import annotations

import re
from typing import Any, Literal

from unirl_lightning.rewards.base import Reward

__all__ = ["AnswerFormat", "ReasoningGymReward", "extract"]

AnswerFormat = Literal["answer_tag", "boxed", "last_line", "last_number", "full"]


def extract(completion: str, answer_format: AnswerFormat) -> str | None:
    """The answer a completion gives, or None when it gives none in ``answer_format``:
    ``answer_tag`` (the last ``<answer>...</answer>``, reasoning-gym's own extractor), ``boxed`` (the
    last ``\\boxed{...}``, math-verify's extractor), ``last_line`` (the last non-empty line),
    ``last_number`` (the last integer or decimal, as GSM8K-style recipes read a small model's prose)
    or ``full`` (the whole completion, stripped).

    >>> extract("so <answer> -4 </answer>", "answer_tag"), extract("x \\\\boxed{7}", "boxed"), extract("a\\nb\\n", "last_line")
    ('-4', '7', 'b')
    >>> extract("48 + 16 = 64.", "last_number"), extract("it is -1,250.5 legs", "last_number"), extract("none", "last_number")
    ('64', '-1250.5', None)
    """
    if answer_format == "answer_tag":
        from reasoning_gym.utils import extract_answer

        return extract_answer(completion)
    if answer_format == "boxed":
        from latex2sympy2_extended.math_normalization import extract_boxed_content

        content = extract_boxed_content(completion)
        return content.strip() if content != completion else None
    if answer_format == "last_number":
        numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", completion)
        return numbers[-1].replace(",", "") if numbers else None
    if answer_format == "last_line":
        lines = [line.strip() for line in completion.splitlines() if line.strip()]
        return lines[-1] if lines else None
    return completion.strip() or None


class ReasoningGymReward(Reward):
    """reasoning-gym's score for the answer a completion gives (0 when it gives none).

    Args:
        answer_format: where the answer is read: ``answer_tag`` (``<answer>...</answer>``), ``boxed``,
            ``last_line``, ``last_number`` or ``full`` (see :func:`extract`). Log the format apart by combining this
            reward with a :class:`~unirl_lightning.rewards.FormatReward` in a
            :class:`~unirl_lightning.rewards.CombinedReward` (each part is logged as
            ``rollout/reward/<name>_mean``).
        entry_key: the record key holding reasoning-gym's entry.

    Example::

        reward: {class_path: unirl_lightning.rewards.ReasoningGymReward, init_args: {answer_format: boxed}}
    """

    name = "reasoning_gym"

    def __init__(self, answer_format: AnswerFormat = "answer_tag", entry_key: str = "reasoning_gym") -> None:
        if answer_format not in AnswerFormat.__args__:
            raise ValueError(
                f"answer_format={answer_format!r}: expected one of {list(AnswerFormat.__args__)}"
            )
        self.answer_format = answer_format
        self.entry_key = entry_key
        self._scorers: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:  # the scorers are rebuilt where the reward runs
        return {**self.__dict__, "_scorers": {}}

    def score(self, completion: str, record: dict) -> float:
        entry = record.get(self.entry_key)
        if not isinstance(entry, dict) or "metadata" not in entry:
            raise ValueError(
                f"ReasoningGymReward: the record has no reasoning-gym entry under {self.entry_key!r} (keys: "
                f"{sorted(record)}); train on data.init_args.train='reasoning_gym:<name>'"
            )
        answer = extract(completion, self.answer_format)
        if answer is None:
            return 0.0
        name = entry["metadata"]["source_dataset"]
        if name not in self._scorers:
            from reasoning_gym import get_score_answer_fn

            self._scorers[name] = get_score_answer_fn(name)
        return float(self._scorers[name](answer, entry))
