"""Math answer checking with the ``math_verify`` library (Hugging Face Math-Verify).

Contract: :class:`MathVerifyReward` parses the gold answer and the completion with
``math_verify.parse`` and compares them with ``math_verify.verify`` (through
:class:`~unirl_lightning.rewards.math_check.AnswerChecker`); no answer checking is done here by
hand. It is safe to call from any thread, and every parse and comparison is bounded by
``timeout_seconds`` on every thread: ``math_verify`` bounds its work with ``signal.alarm``, which
works only on the main thread, so off it the check runs in a long-lived child process whose main
thread does the same. A check that runs out scores ``incorrect`` and is logged with its texts.
"""

from __future__ import annotations

from unirl_lightning.rewards.base import Reward, _record_field
from unirl_lightning.rewards.math_check import AnswerChecker

__all__ = ["MathVerifyReward"]


class MathVerifyReward(Reward):
    """``correct`` when ``math_verify`` finds the completion's answer equal to the gold answer.

    The gold answer is ``str(record[answer_key])``; both sides go through ``math_verify.parse``
    (LaTeX such as ``\\boxed{7}`` and plain expressions such as ``1/2`` are extracted), then
    ``math_verify.verify(gold, prediction)``. A completion with no parseable answer scores
    ``incorrect``. Verdicts are cached per (gold, completion): a group's repeated completions cost
    one check. :attr:`timeouts` counts the parses and comparisons that ran out of time.

    Args:
        answer_key: Record key holding the gold answer.
        correct: Reward when the answers match.
        incorrect: Reward otherwise.
        timeout_seconds: Bound on each parse and each comparison, on any thread (see the module
            docstring); ``None`` or ``0`` disables it, and then a pathological completion (such as
            ``8888** 8** 8``, minutes of sympy) holds the worker until it is done.

    Example::

        >>> reward = MathVerifyReward()
        >>> reward(["The answer is \\\\boxed{7}", "8", "0.5"], [{"answer": "7"}, {"answer": "7"}, {"answer": "1/2"}])
        [1.0, 0.0, 1.0]
    """

    name = "math_verify"

    def __init__(
        self,
        answer_key: str = "answer",
        correct: float = 1.0,
        incorrect: float = 0.0,
        timeout_seconds: int | None = 5,
    ) -> None:
        if timeout_seconds is not None and (not isinstance(timeout_seconds, int) or timeout_seconds < 0):
            raise ValueError(
                f"MathVerifyReward timeout_seconds={timeout_seconds!r} is invalid; expected None or an int >= 0."
            )
        try:
            import math_verify  # noqa: F401  (fail at construction, not on the first batch)
        except ImportError as err:
            raise ImportError(
                "MathVerifyReward needs the 'math-verify' package: pip install 'math-verify>=0.7'."
            ) from err
        self.answer_key = answer_key
        self.correct = float(correct)
        self.incorrect = float(incorrect)
        self.timeout_seconds = timeout_seconds
        self.checker = AnswerChecker(timeout_seconds)

    @property
    def timeouts(self) -> int:
        """Parses and comparisons that ran out of ``timeout_seconds`` so far (each scored ``incorrect``)."""
        return self.checker.timeouts

    def __call__(self, completions: list[str], records: list[dict]) -> list[float]:
        golds = [str(_record_field(record, self.answer_key, self.name)) for record in records]
        verdicts = self.checker.check(list(zip(golds, completions)))
        return [self.correct if ok else self.incorrect for ok in verdicts]

    def score(self, completion: str, record: dict) -> float:
        return self([completion], [record])[0]
