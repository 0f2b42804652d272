"""Built-in verifiable prompt tasks, generated locally (no download).

Contract: every task is a pure function of ``(num_prompts, seed, **kwargs)`` that returns
``num_prompts`` prompt records ``{"prompt": str, "answer": str, "task": str, ...}``. The same
arguments always give the same records (a private ``random.Random(seed)`` is used, never the
global RNG). Answers are checked by :class:`~unirl_lightning.rewards.ExactMatchReward` or
:class:`~unirl_lightning.rewards.MathVerifyReward`.

* ``digit_successor``, ``copy_first``, ``add_mod10``: prompts use only ``0-9``, ``+``, ``=`` and
  space, and answers are one digit, so a character-level policy with a ~20-token vocabulary
  learns them from scratch (tests and the CPU demo). Their prompt spaces are tiny
  (``digit_successor`` has 10 prompts, ``add_mod10`` 100).
* ``python_functions``: HumanEval-style code completion for a character-level policy: the prompt is
  a Python function up to ``return x`` and its docstring says what it returns (``x * 3 + 4``); the
  completion continues the expression (``*3+4``, in the digit vocabulary). Records carry ``tests``
  (``{"input": [x], "output": f(x)}``) for :class:`~unirl_lightning.rewards.CodeExecutionReward`
  with ``prefix_key="prompt"``.
* ``word_problems``: GSM8K-style arithmetic word problems for a pretrained instruct model, with
  the answer asked for in ``\\boxed{}`` (a practically unbounded prompt space;
  :mod:`unirl_lightning.data.word_problems`).

Train / held-out split: :func:`is_held_out` partitions every task's prompt space by a hash of the
prompt, and ``make_task(..., partition="train" | "held_out")`` draws from one side only, so held-out
prompts are never trained on, for any seed and size. Without ``partition``, records drawn with two
seeds may overlap.

Example::

    >>> from unirl_lightning.data.tasks import make_task
    >>> make_task("add_mod10", num_prompts=2, seed=0)
    [{'prompt': '6+6=', 'answer': '2', 'task': 'add_mod10'}, {'prompt': '0+4=', 'answer': '4', 'task': 'add_mod10'}]
"""

from __future__ import annotations

import hashlib
import inspect
import random
from collections.abc import Callable
from typing import Literal, get_args

from unirl_lightning.data.word_problems import (
    EASY_WORD_PROBLEM_TEMPLATES,
    WORD_PROBLEM_INSTRUCTION,
    WORD_PROBLEM_TEMPLATES,
    word_problems,
)

__all__ = [
    "BUILTIN_TASKS",
    "EASY_WORD_PROBLEM_TEMPLATES",
    "HELD_OUT_PERCENT",
    "Partition",
    "Split",
    "WORD_PROBLEM_INSTRUCTION",
    "WORD_PROBLEM_TEMPLATES",
    "add_mod10",
    "copy_first",
    "digit_successor",
    "is_held_out",
    "make_task",
    "python_functions",
    "word_problems",
]


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


# ---------------------------------------------------------------- code

PYTHON_FUNCTION_INPUTS = (0, 1, 2, 7, -3)
"""The arguments every ``python_functions`` record tests ``f`` on."""


def python_functions(num_prompts: int, seed: int) -> list[dict]:
    """Complete ``def f(x): return x`` so that ``f(x) == x * a + b`` (or ``x * a - b``).

    ``a`` is a digit ``1-9``, ``b`` a digit ``0-9`` (180 prompts). The prompt is the function with a
    docstring stating the expression, ending in ``return x``; the answer is the reference
    continuation (``"*3+4"``); ``tests`` call ``f`` on :data:`PYTHON_FUNCTION_INPUTS`; the entry
    point is ``"f"``. Scored by running ``prompt + completion``
    (:class:`~unirl_lightning.rewards.CodeExecutionReward` with ``prefix_key="prompt"``), so a
    completion such as ``"+6"`` for ``x * 7 + 6`` passes the test at ``x = 0`` only (a score of 0.2).

    Example::

        >>> record = python_functions(1, seed=0)[0]
        >>> print(record["prompt"] + record["answer"])
        def f(x):
            \"\"\"Return x * 7 + 6.\"\"\"
            return x*7+6
        >>> record["tests"][:2]
        [{'input': [0], 'output': 6}, {'input': [1], 'output': 13}]
    """
    rng = random.Random(seed)
    records = []
    for _ in range(num_prompts):
        a, b, sign = rng.randint(1, 9), rng.randint(0, 9), rng.choice("+-")
        offset = b if sign == "+" else -b
        records.append(
            {
                "prompt": f'def f(x):\n    """Return x * {a} {sign} {b}."""\n    return x',
                "answer": f"*{a}{sign}{b}",
                "tests": [{"input": [x], "output": x * a + offset} for x in PYTHON_FUNCTION_INPUTS],
                "entry_point": "f",
                "task": "python_functions",
            }
        )
    return records


# ---------------------------------------------------------------- registry and splits

BUILTIN_TASKS: dict[str, Callable[..., list[dict]]] = {
    "digit_successor": digit_successor,
    "copy_first": copy_first,
    "add_mod10": add_mod10,
    "python_functions": python_functions,
    "word_problems": word_problems,
}
"""Built-in task name -> generator ``(num_prompts, seed, **kwargs) -> list[dict]``."""


HELD_OUT_PERCENT = 10
"""Share (in percent) of every task's prompt space that forms the held-out partition."""

Partition = Literal["train", "held_out"]
Split = Partition  # the former name


def is_held_out(prompt: str) -> bool:
    """Whether ``prompt`` is in the held-out partition of the prompt space.

    A pure function of the prompt text (the first 8 bytes of its SHA-256, mod 100, below
    :data:`HELD_OUT_PERCENT`): the same on every machine, process and Python version, and
    independent of seeds and sizes. Identical prompts are always on the same side.
    """
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELD_OUT_PERCENT


def make_task(
    name: str, num_prompts: int, seed: int, partition: Partition | None = None, **kwargs
) -> list[dict]:
    """Build ``num_prompts`` records of the built-in task ``name``, deterministically from ``seed``.

    With ``partition=None`` the records are the task's first ``num_prompts`` draws. With ``partition``
    ``"train"`` (or ``"held_out"``) they are the first ``num_prompts`` draws whose prompt is not (or
    is) :func:`is_held_out`, so a ``"train"`` and a ``"held_out"`` list never share a prompt, for any
    seeds and sizes. Each side keeps the task's own mix of prompts, minus the other side's.

    Raises:
        ValueError: ``name`` is not in :data:`BUILTIN_TASKS`, ``num_prompts`` is negative, ``partition``
            is not ``None``/``"train"``/``"held_out"``, a task keyword is unknown or out of range, or
            the requested side of the split has no prompt among many draws (a prompt space too small
            to split, e.g. ``digit_successor`` without ``prefix_len``).

    Example::

        >>> make_task("digit_successor", num_prompts=1, seed=3, prefix_len=2)
        [{'prompt': '39 8=', 'answer': '9', 'task': 'digit_successor'}]
        >>> make_task("digit_successor", num_prompts=2, seed=0, partition="held_out")
        [{'prompt': '5=', 'answer': '6', 'task': 'digit_successor'}, {'prompt': '5=', 'answer': '6', 'task': 'digit_successor'}]
    """
    if name not in BUILTIN_TASKS:
        raise ValueError(f"Unknown built-in task {name!r}; expected one of {sorted(BUILTIN_TASKS)}.")
    if not isinstance(num_prompts, int) or isinstance(num_prompts, bool) or num_prompts < 0:
        raise ValueError(f"num_prompts={num_prompts!r} is invalid for task {name!r}; expected an int >= 0.")
    if partition not in (None, *get_args(Partition)):
        raise ValueError(
            f"partition={partition!r} is invalid for task {name!r}; expected None, 'train' or 'held_out'."
        )
    generator = BUILTIN_TASKS[name]
    allowed = [p for p in inspect.signature(generator).parameters if p not in ("num_prompts", "seed")]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(f"Task {name!r} got unknown keyword arguments {unknown}; allowed: {allowed}.")
    if partition is None or num_prompts == 0:
        return generator(num_prompts, seed, **kwargs)
    want_held_out = partition == "held_out"
    max_draws = 64 * num_prompts + 4096
    draws = 2 * num_prompts
    while True:
        draws = min(max(draws, 64), max_draws)
        kept = [r for r in generator(draws, seed, **kwargs) if is_held_out(r["prompt"]) == want_held_out]
        if len(kept) >= num_prompts:
            return kept[:num_prompts]
        if draws == max_draws:
            raise ValueError(
                f"Task {name!r} (kwargs {kwargs}) gave {len(kept)} of the {num_prompts} {partition!r} prompts asked "
                f"for in {draws} draws: its prompt space is too small to split ({HELD_OUT_PERCENT}% of prompts, "
                "by hash, are held out). Use a larger prompt space (e.g. prefix_len for digit_successor) or "
                "PromptDataModule(held_out='resample')."
            )
        draws *= 4
