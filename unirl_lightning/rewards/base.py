"""Reward contract, generic rewards and the one checked entry point :func:`score_batch`.

Contract: a reward is a picklable object (it is shipped to Ray worker processes) with a
``name: str`` and ``__call__(completions: list[str], records: list[dict]) -> list[float]``
that scores a batch; ``records[i]`` is the prompt record (``{"prompt", "answer", ...}``) that
``completions[i]`` answers. Callers (rollout workers, the eval callback) never call a reward
directly: they call :func:`score_batch`, which guarantees one finite float per completion or
raises :class:`RewardError` naming the reward and the batch's first prompt.

Subclasses of :class:`Reward` either implement ``score(completion, record) -> float`` (the
default ``__call__`` loops over the batch) or override ``__call__`` to score a batch at once.

Example::

    >>> from unirl_lightning.rewards import CombinedReward, ExactMatchReward, FormatReward, score_batch
    >>> reward = CombinedReward([ExactMatchReward(), FormatReward(r"\\d")], weights=[1.0, 0.1])
    >>> score_batch(reward, ["7", "x"], [{"prompt": "6+1=", "answer": "7"}] * 2)
    [1.1, 0.0]
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "Reward",
    "RewardError",
    "ExactMatchReward",
    "FormatReward",
    "CallableFunction",
    "CallableReward",
    "CombinedReward",
    "import_callable",
    "score_batch",
    "resolve_reward",
    "reward_name",
]

_PROMPT_PREVIEW_CHARS = 200


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


def import_callable(path: str) -> Callable:
    """Import ``"pkg.mod:attr.sub"`` or ``"pkg.mod.attr"`` and return the attribute."""
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
        candidates = [(module_name, attr_path)]
    else:
        parts = path.split(".")
        candidates = [(".".join(parts[:i]), ".".join(parts[i:])) for i in range(len(parts) - 1, 0, -1)]
    if not path or not all(module and attrs for module, attrs in candidates) or not candidates:
        raise ValueError(
            f"Reward path {path!r} is invalid; expected 'package.module:function' or 'package.module.function'."
        )
    errors = []
    for module_name, attr_path in candidates:
        try:
            target: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
                errors.append(f"no module {module_name!r}")
                continue  # the module itself is missing: try a shorter module prefix
            raise ImportError(f"Reward path {path!r}: importing {module_name!r} failed: {err}") from err
        try:
            for attr in attr_path.split("."):
                target = getattr(target, attr)
        except AttributeError:
            raise ImportError(
                f"Reward path {path!r}: module {module_name!r} has no attribute {attr_path!r}."
            ) from None
        if not callable(target):
            raise TypeError(f"Reward path {path!r} resolves to {target!r}, which is not callable.")
        return target
    raise ImportError(f"Reward path {path!r} could not be imported ({'; '.join(errors)}).")


class CallableFunction:
    """A function given as itself or as its import path, resolved on first use.

    A path (``"pkg.mod:func"`` / ``"pkg.mod.func"``) is imported lazily, so the holder pickles as
    the string and the function only needs to be importable where it is called (e.g. on a Ray
    worker); a function object must itself be picklable (defined at module level). Shared by
    :class:`CallableReward` and the image rewards' ``CallableImageReward``.
    """

    def __init__(self, fn: str | Callable[..., Any], name: str | None = None) -> None:
        if not isinstance(fn, str) and not callable(fn):
            raise TypeError(f"fn must be a callable or an import path string, got {fn!r}")
        self.fn = fn
        self.name = name or (fn if isinstance(fn, str) else getattr(fn, "__name__", type(fn).__name__))
        self._resolved: Callable | None = None if isinstance(fn, str) else fn

    @property
    def function(self) -> Callable[..., Any]:
        """The resolved function (imports ``fn`` on first access when it is a path)."""
        if self._resolved is None:
            self._resolved = import_callable(self.fn)  # type: ignore[arg-type]
        return self._resolved

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if isinstance(self.fn, str):
            state["_resolved"] = None  # ship the path, not the imported function
        return state


class CallableReward(CallableFunction, Reward):
    """Wrap a per-sample function ``fn(completion, record) -> float`` as a batch reward.

    Args:
        fn: The function, or its import path ``"pkg.mod:func"`` / ``"pkg.mod.func"`` (see
            :class:`CallableFunction`).
        name: Reward name for logs and errors; defaults to the path or the function's ``__name__``.

    Example::

        # my_rewards.py:  def short(completion, record): return float(len(completion) <= 5)
        reward = CallableReward("my_rewards:short")
        reward(["7", "123456"], [{"prompt": "6+1="}, {"prompt": "6+1="}])  # -> [1.0, 0.0]

        # YAML (LightningCLI):
        # reward:
        #   class_path: unirl_lightning.rewards.CallableReward
        #   init_args: {fn: my_rewards.short}
    """

    def score(self, completion: str, record: dict) -> float:
        return self.function(completion, record)


def resolve_reward(reward: Reward | str | Callable) -> Reward | Callable:
    """Return ``reward`` itself, or a :class:`CallableReward` when it is an import path string."""
    if isinstance(reward, str):
        return CallableReward(reward)
    if not callable(reward):
        raise TypeError(
            f"Reward {reward!r} is not callable; expected a Reward, a callable "
            "(completions, records) -> list[float], or an import path 'pkg.mod:func'."
        )
    return reward


def reward_name(reward: Any) -> str:
    """The name used for ``reward`` in logs and errors."""
    if isinstance(reward, str):
        return reward
    name = getattr(reward, "name", None)
    if isinstance(name, str) and name:
        return name
    return getattr(reward, "__name__", type(reward).__name__)


def _prompt_preview(records: Sequence[dict]) -> str:
    if not records:
        return "<empty batch>"
    first = records[0]
    prompt = str(first.get("prompt", "<no 'prompt' key>")) if isinstance(first, dict) else repr(first)
    if len(prompt) > _PROMPT_PREVIEW_CHARS:
        prompt = prompt[:_PROMPT_PREVIEW_CHARS] + "..."
    return repr(prompt)


def score_batch(reward: Reward | str | Callable, completions: list[str], records: list[dict]) -> list[float]:
    """Score a batch with ``reward`` and check the result: one finite float per completion.

    ``reward`` may be a :class:`Reward`, any callable ``(completions, records) -> list[float]``
    with an optional ``name``, or an import path of a per-sample function (wrapped in
    :class:`CallableReward`).

    Raises:
        ValueError: ``completions`` and ``records`` differ in length.
        RewardError: the reward raised (chained as ``__cause__``), returned a different number of
            scores than completions, or returned a value that is not a finite number. The message
            names the reward and the first prompt of the batch.
    """
    reward = resolve_reward(reward)
    name = reward_name(reward)
    if len(completions) != len(records):
        raise ValueError(
            f"score_batch for reward {name!r} got {len(completions)} completions but {len(records)} records; "
            "expected one record per completion."
        )
    where = f"reward {name!r} on the batch whose first prompt is {_prompt_preview(records)}"
    try:
        scores = reward(completions, records)
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
    checked = []
    for index, value in enumerate(scores):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise RewardError(f"{where} returned score {value!r} at index {index}; expected a finite float.")
        checked.append(number)
    return checked


class CombinedReward(Reward):
    """Weighted sum of several rewards: ``sum(w_k * reward_k(completions, records))``.

    Each component is scored through :func:`score_batch`, so a failing component raises a
    :class:`RewardError` naming that component.

    Args:
        rewards: Components: :class:`Reward` objects or import paths of per-sample functions.
        weights: One weight per component; defaults to 1.0 each.

    Example::

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

    def __call__(self, completions: list[str], records: list[dict]) -> list[float]:
        totals = [0.0] * len(completions)
        for reward, weight in zip(self.rewards, self.weights):
            for index, value in enumerate(score_batch(reward, completions, records)):
                totals[index] += weight * value
        return totals
