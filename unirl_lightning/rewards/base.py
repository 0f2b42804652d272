"""Reward contract, generic rewards and the one checked entry point :func:`score_batch`.

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

import asyncio
import concurrent.futures
import importlib
import inspect
import math
import re
import threading
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
    "is_batched_function",
    "part_name",
    "run_coroutine",
    "score_batch",
    "score_parts",
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


def _import_file(path: str, file: str) -> Any:
    """The module of the Python file ``file`` (loaded once per process, by its absolute path)."""
    import importlib.util
    import sys
    from pathlib import Path

    location = Path(file).expanduser().resolve()
    if not location.is_file():
        raise ImportError(f"Reward path {path!r}: there is no file {file!r} (looked at {location}).")
    name = "_unirl_reward_file_" + re.sub(r"\W", "_", str(location))
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, location)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except BaseException as err:
            del sys.modules[name]
            raise ImportError(f"Reward path {path!r}: importing {file!r} failed: {err}") from err
    return module


def absolute_file_path(path: str) -> str:
    """``"dir/file.py:fn"`` with the file made absolute (so a worker in another folder finds it);
    any other path unchanged."""
    file, sep, attr = path.rpartition(":")
    if sep and file.endswith(".py"):
        from pathlib import Path

        return f"{Path(file).expanduser().resolve()}:{attr}"
    return path


def _callable_attribute(path: str, owner: Any, where: str, attr_path: str) -> Any:
    """``owner``'s dotted attribute ``attr_path``, which must be callable (errors name ``path``)."""
    target = owner
    try:
        for attr in attr_path.split("."):
            target = getattr(target, attr)
    except AttributeError:
        raise ImportError(f"Reward path {path!r}: {where} has no attribute {attr_path!r}.") from None
    if not callable(target):
        raise TypeError(f"Reward path {path!r} resolves to {target!r}, which is not callable.")
    return target


def import_callable(path: str) -> Callable:
    """Import ``"pkg.mod:attr.sub"``, ``"pkg.mod.attr"`` or ``"path/to/file.py:attr"`` (a Python
    file, relative to the working directory) and return the attribute."""
    file, sep, attr_path = path.rpartition(":")
    if sep and file.endswith(".py") and attr_path:
        return _callable_attribute(path, _import_file(path, file), f"file {file!r}", attr_path)
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
            target = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
                errors.append(f"no module {module_name!r}")
                continue  # the module itself is missing: try a shorter module prefix
            raise ImportError(f"Reward path {path!r}: importing {module_name!r} failed: {err}") from err
        return _callable_attribute(path, target, f"module {module_name!r}", attr_path)
    raise ImportError(f"Reward path {path!r} could not be imported ({'; '.join(errors)}).")


class CallableFunction:
    """A function given as itself or as its import path, resolved on first use.

    A path (``"pkg.mod:func"`` / ``"pkg.mod.func"``, or ``"path/to/file.py:func"``, made absolute
    here so a worker in another folder finds the file) is imported lazily, so the holder pickles as
    the string and the function only needs to be importable where it is called (e.g. on a Ray
    worker); a function object must itself be picklable (defined at module level). Shared by
    :class:`CallableReward` and the image rewards' ``CallableImageReward``.
    """

    def __init__(self, fn: str | Callable[..., Any], name: str | None = None) -> None:
        if not isinstance(fn, str) and not callable(fn):
            raise TypeError(f"fn must be a callable or an import path string, got {fn!r}")
        self.name = name or (fn if isinstance(fn, str) else getattr(fn, "__name__", type(fn).__name__))
        self.fn = absolute_file_path(fn) if isinstance(fn, str) else fn
        self._named = name is not None
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


_EXTRAS = ("completion_ids", "finish_reasons")
"""Per-sample values a batched (TRL-style) function receives when its signature accepts them."""

_loops = threading.local()


def run_coroutine(awaitable: Any) -> Any:
    """Run ``awaitable`` to completion from synchronous code and return its result.

    The calling thread keeps one event loop of its own for all calls (so a judge's HTTP session can
    live across batches); when a loop is already running in this thread (an async actor), the
    coroutine runs on a helper thread's fresh loop instead.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        loop = getattr(_loops, "loop", None)
        if loop is None or loop.is_closed():
            loop = _loops.loop = asyncio.new_event_loop()
        return loop.run_until_complete(awaitable)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, awaitable).result()


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none
        return None


def is_batched_function(fn: Callable) -> bool:
    """Whether ``fn`` is called TRL's way: its first parameter is named ``completions`` (and its
    second is not ``records``: ``fn(completions, records)`` is this library's own batch contract)."""
    signature = _signature(fn)
    if signature is None:
        return False
    params = list(signature.parameters.values())
    return (
        bool(params)
        and params[0].name == "completions"
        and not (len(params) > 1 and params[1].name == "records")
    )


def _is_batch_contract(fn: Callable) -> bool:
    signature = _signature(fn)
    params = list(signature.parameters.values()) if signature is not None else []
    return len(params) > 1 and params[0].name == "completions" and params[1].name == "records"


def _is_async(fn: Callable) -> bool:
    target = fn if inspect.isroutine(fn) else type(fn).__call__  # an object: its __call__
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(target)


def _batched_kwargs(fn: Callable, records: list[dict], extras: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a batched call: ``prompts``, one list per record key, and the
    extras (``completion_ids``, ``finish_reasons``) the signature accepts."""
    columns: dict[str, list] = {}
    for record in records:
        for key in record:
            columns.setdefault(key, [])
    for key in columns:
        columns[key] = [record.get(key) for record in records]
    columns.pop("prompt", None)
    kwargs: dict[str, Any] = {"prompts": [record.get("prompt") for record in records], **columns}
    kwargs.update({key: value for key, value in extras.items() if key in _EXTRAS and value is not None})
    signature = _signature(fn)
    if signature is None:
        return kwargs
    params = list(signature.parameters.values())[1:]
    if not any(param.kind is inspect.Parameter.VAR_KEYWORD for param in params):
        accepted = {param.name for param in params if param.kind is not inspect.Parameter.POSITIONAL_ONLY}
        kwargs = {key: value for key, value in kwargs.items() if key in accepted}
    missing = [
        param.name
        for param in params
        if param.default is inspect.Parameter.empty
        and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and param.name not in kwargs
    ]
    if missing:
        raise TypeError(
            f"it needs the keyword argument(s) {missing}, but the records have the keys {sorted(columns)} "
            f"(plus 'prompts' and {list(_EXTRAS)}); set prompt_key/answer_key or give the column a default."
        )
    return kwargs


class CallableReward(CallableFunction, Reward):
    """Wrap a plain function as a batch reward; how it is called is read off its signature.

    Calling rule:

    * **TRL-style (batched)**: the first parameter is named ``completions``. The function is called
      once per batch (in a rollout worker: all the samples of one request, every group's) as
      ``fn(completions, prompts=[...], **columns)`` where ``columns`` holds one list per record key
      (every dataset column: ``answer``, ``solution``, ...; ``prompts`` is each record's ``"prompt"``),
      plus ``completion_ids`` (token ids per sample) and ``finish_reasons`` (``"stop"`` / ``"length"``)
      where the caller has them. Only the keywords the signature accepts are passed (all of them
      when it has ``**kwargs``). It returns one ``float | None`` per completion: ``None`` means "no
      opinion" (as in TRL): in a :class:`CombinedReward` it is left out of the weighted sum, and a
      sample that every component (or the only function) says ``None`` to scores 0.
    * **Batch contract**: ``fn(completions, records) -> list[float]`` (second parameter named
      ``records``), once per batch, as a :class:`Reward`.
    * **Per sample**: any other signature, ``fn(completion, record) -> float``, once per completion.
    * ``async def`` functions (either kind) are awaited inside the worker on a loop kept per
      thread; the per-sample calls of a batch are gathered concurrently, so an HTTP judge does not
      score one sample at a time.

    Args:
        fn: The function, or its import path ``"pkg.mod:func"`` / ``"pkg.mod.func"`` (see
            :class:`CallableFunction`).
        name: Reward name for errors; defaults to the path or the function's ``__name__``. The
            per-reward figures use :func:`part_name` (the function's own name).

    Example::

        # my_rewards.py:  def short(completion, record): return float(len(completion) <= 5)
        reward = CallableReward("my_rewards:short")
        reward(["7", "123456"], [{"prompt": "6+1="}, {"prompt": "6+1="}])  # -> [1.0, 0.0]

        # TRL-style: def digit(completions, solution, **kwargs): return [float(c == s) for ...]
        # YAML (LightningCLI):
        # reward: my_rewards:digit
        # or reward: {class_path: unirl_lightning.rewards.CallableReward, init_args: {fn: my_rewards.short}}
    """

    @property
    def allows_none(self) -> bool:
        """A batched function may answer ``None`` ("no opinion")."""
        return is_batched_function(self.function)

    def __call__(self, completions: list[str], records: list[dict], **extras: Any) -> list:
        fn = self.function
        if is_batched_function(fn):
            result = fn(completions, **_batched_kwargs(fn, records, extras))
            if inspect.isawaitable(result):
                result = run_coroutine(result)
            return result
        if _is_batch_contract(fn):
            result = fn(completions, records)
            return run_coroutine(result) if inspect.isawaitable(result) else result
        if _is_async(fn):

            async def gather() -> list:
                return await asyncio.gather(*(fn(c, r) for c, r in zip(completions, records)))

            return [float(value) for value in run_coroutine(gather())]
        return [float(fn(completion, record)) for completion, record in zip(completions, records)]

    def score(self, completion: str, record: dict) -> float:
        return self.__call__([completion], [record])[0]


def resolve_reward(reward: Reward | str | Callable) -> Reward | Callable:
    """Return ``reward`` itself, or a :class:`CallableReward` when it is an import path string or a
    plain TRL-style function (first parameter ``completions``, see :class:`CallableReward`)."""
    if isinstance(reward, str):
        return CallableReward(reward)
    if inspect.isroutine(reward) and is_batched_function(reward):
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
