"""Built-in verifiable prompt tasks, small enough for a CPU demo.

Contract: every task is a pure function of ``(num_prompts, seed, **kwargs)`` that returns
``num_prompts`` prompt records ``{"prompt": str, "answer": str, "task": str}``. The same
arguments always give the same records (a private ``random.Random(seed)`` is used, never the
global RNG). Prompts only use the characters ``0-9``, ``+``, ``=`` and space, so a
character-level policy with a ~20-token vocabulary can learn them from scratch; answers are a
single digit, checked by :class:`~unirl_lightning.rewards.ExactMatchReward` or
:class:`~unirl_lightning.rewards.MathVerifyReward`.

The prompt spaces are tiny (``add_mod10`` has 100 distinct prompts), so records drawn with two
different seeds may overlap; they are for smoke tests and demos, not for measuring
generalisation.

Example::

    >>> from unirl_lightning.data.tasks import make_task
    >>> make_task("add_mod10", num_prompts=2, seed=0)
    [{'prompt': '6+6=', 'answer': '2', 'task': 'add_mod10'}, {'prompt': '0+4=', 'answer': '4', 'task': 'add_mod10'}]
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable

__all__ = ["BUILTIN_TASKS", "make_task", "digit_successor", "copy_first", "add_mod10"]


def _random_digits(rng: random.Random, count: int) -> str:
    return "".join(str(rng.randrange(10)) for _ in range(count))


def _check_non_negative(task: str, key: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"Task {task!r}: {key}={value!r} is invalid; expected an int >= 0.")


def digit_successor(num_prompts: int, seed: int, prefix_len: int = 0) -> list[dict]:
    """Prompt ``"<d>="``, answer ``(d + 1) % 10``.

    With ``prefix_len > 0`` the prompt starts with that many random distractor digits and a
    space, e.g. ``"48 3="`` -> ``"4"``.
    """
    _check_non_negative("digit_successor", "prefix_len", prefix_len)
    rng = random.Random(seed)
    records = []
    for _ in range(num_prompts):
        prefix = _random_digits(rng, prefix_len) + " " if prefix_len else ""
        digit = rng.randrange(10)
        records.append(
            {"prompt": f"{prefix}{digit}=", "answer": str((digit + 1) % 10), "task": "digit_successor"}
        )
    return records


def copy_first(num_prompts: int, seed: int, length: int = 3) -> list[dict]:
    """Prompt ``"<length random digits>="``, answer the first digit, e.g. ``"507="`` -> ``"5"``."""
    _check_non_negative("copy_first", "length", length)
    if length == 0:
        raise ValueError("Task 'copy_first': length=0 is invalid; expected an int >= 1.")
    rng = random.Random(seed)
    records = []
    for _ in range(num_prompts):
        digits = _random_digits(rng, length)
        records.append({"prompt": f"{digits}=", "answer": digits[0], "task": "copy_first"})
    return records


def add_mod10(num_prompts: int, seed: int) -> list[dict]:
    """Prompt ``"<a>+<b>="`` with digits ``a, b``, answer ``(a + b) % 10``, e.g. ``"7+5="`` -> ``"2"``."""
    rng = random.Random(seed)
    records = []
    for _ in range(num_prompts):
        a, b = rng.randrange(10), rng.randrange(10)
        records.append({"prompt": f"{a}+{b}=", "answer": str((a + b) % 10), "task": "add_mod10"})
    return records


BUILTIN_TASKS: dict[str, Callable[..., list[dict]]] = {
    "digit_successor": digit_successor,
    "copy_first": copy_first,
    "add_mod10": add_mod10,
}
"""Built-in task name -> generator ``(num_prompts, seed, **kwargs) -> list[dict]``."""


def make_task(name: str, num_prompts: int, seed: int, **kwargs) -> list[dict]:
    """Build ``num_prompts`` records of the built-in task ``name``, deterministically from ``seed``.

    Raises:
        ValueError: ``name`` is not in :data:`BUILTIN_TASKS`, ``num_prompts`` is negative, or a
            task keyword is unknown or out of range.

    Example::

        >>> make_task("digit_successor", num_prompts=1, seed=3, prefix_len=2)
        [{'prompt': '39 8=', 'answer': '9', 'task': 'digit_successor'}]
    """
    if name not in BUILTIN_TASKS:
        raise ValueError(f"Unknown built-in task {name!r}; expected one of {sorted(BUILTIN_TASKS)}.")
    if not isinstance(num_prompts, int) or isinstance(num_prompts, bool) or num_prompts < 0:
        raise ValueError(f"num_prompts={num_prompts!r} is invalid for task {name!r}; expected an int >= 0.")
    generator = BUILTIN_TASKS[name]
    allowed = [p for p in inspect.signature(generator).parameters if p not in ("num_prompts", "seed")]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(f"Task {name!r} got unknown keyword arguments {unknown}; allowed: {allowed}.")
    return generator(num_prompts, seed, **kwargs)
