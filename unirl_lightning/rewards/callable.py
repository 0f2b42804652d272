"""Plain functions as rewards: :class:`CallableReward` calls a function (or its import path) by one
rule read off its signature, TRL's batched way or per sample, ``async def`` functions awaited.

* first parameter named ``completions``: TRL's way, once per batch,
  ``fn(completions, prompts=[...], <every record key>=[...], completion_ids=..., finish_reasons=...)``
  returning ``list[float | None]``; ``None`` is "no opinion";
* anything else: per sample, ``fn(completion, record) -> float``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Callable
from typing import Any

from unirl_lightning.core.imports import absolute_file_path, import_callable
from unirl_lightning.rewards.base import Reward

__all__ = ["CallableFunction", "CallableReward", "is_batched_function", "resolve_reward", "run_coroutine"]


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
