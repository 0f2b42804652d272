"""Math answer checking with the ``math_verify`` library (Hugging Face Math-Verify).

Contract: :class:`MathVerifyReward` parses the gold answer and the completion with
``math_verify.parse`` and compares them with ``math_verify.verify``; no answer checking is done
here by hand. It is safe to call from any thread: ``math_verify`` implements its timeouts with
``signal.alarm``, which only works on the main thread, so off the main thread (threaded Ray
actors, a thread pool) the reward passes ``parsing_timeout=None`` / ``timeout_seconds=None``,
which disables the signal and the timeout; on the main thread the timeout is enforced.
"""

from __future__ import annotations

import functools
import threading

from unirl_lightning.rewards.base import Reward, _record_field

__all__ = ["MathVerifyReward"]


class MathVerifyReward(Reward):
    """``correct`` when ``math_verify`` finds the completion's answer equal to the gold answer.

    The gold answer is ``str(record[answer_key])``; both sides go through ``math_verify.parse``
    (LaTeX such as ``\\boxed{7}`` and plain expressions such as ``1/2`` are extracted), then
    ``math_verify.verify(gold, prediction)``. A completion with no parseable answer scores
    ``incorrect``.

    Args:
        answer_key: Record key holding the gold answer.
        correct: Reward when the answers match.
        incorrect: Reward otherwise.
        timeout_seconds: Per-parse / per-comparison timeout, enforced only when called on the main
            thread (``math_verify`` uses ``signal.alarm``); ``None`` or ``0`` disables it.

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

    def _timeout(self) -> int | None:
        # signal.alarm (math_verify's timeout) raises ValueError off the main thread.
        if threading.current_thread() is not threading.main_thread():
            return None
        return self.timeout_seconds or None

    def score(self, completion: str, record: dict) -> float:
        from math_verify import verify

        timeout = self._timeout()
        gold = _parse(str(_record_field(record, self.answer_key, self.name)), timeout)
        prediction = _parse(completion, timeout)
        if not gold or not prediction:
            return self.incorrect
        return self.correct if verify(gold, prediction, timeout_seconds=timeout) else self.incorrect


@functools.lru_cache(maxsize=8192)
def _parse(text: str, timeout: int | None) -> list:
    """``math_verify.parse``, memoised: a group repeats its gold answer, and short completions repeat."""
    from math_verify import parse

    return parse(text, parsing_timeout=timeout)
