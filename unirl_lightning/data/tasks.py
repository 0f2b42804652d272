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
  the answer asked for in ``\\boxed{}`` (a practically unbounded prompt space).

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

__all__ = [
    "BUILTIN_TASKS",
    "HELD_OUT_PERCENT",
    "Partition",
    "Split",
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


# ---------------------------------------------------------------- word problems

WORD_PROBLEM_INSTRUCTION = "Give only the final answer, written as \\boxed{number}, e.g. \\boxed{42}."
"""Default instruction appended to every word problem (on its own line). The worked example matters
for a small model: untrained SmolLM2-135M-Instruct boxes ~1/3 of its answers with it, ~1/30 without."""

_NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Keiko", "Liam")
_Problem = tuple[str, str, int]  # (problem text, arithmetic expression, answer)
_ITEMS = ("apples", "marbles", "stickers", "cookies", "pencils", "cards", "shells", "beads")


def _buy_and_give(rng: random.Random) -> _Problem:
    name, items = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(12, 400), rng.randint(10, 250)
    c = rng.randint(5, a + b - 1)
    text = (
        f"{name} has {a} {items}. {name} buys {b} more and then gives {c} to a friend. "
        f"How many {items} does {name} have now?"
    )
    return text, f"{a} + {b} - {c}", a + b - c


def _boxes_and_leftovers(rng: random.Random) -> _Problem:
    name, items = rng.choice(_NAMES), rng.choice(_ITEMS)
    per_box, boxes = rng.randint(6, 48), rng.randint(3, 40)
    left = rng.randint(1, per_box - 1)
    text = (
        f"A box holds {per_box} {items}. {name} fills {boxes} boxes and has {left} {items} left over. "
        f"How many {items} did {name} start with?"
    )
    return text, f"{per_box} * {boxes} + {left}", per_box * boxes + left


def _weekly_wage(rng: random.Random) -> _Problem:
    name = rng.choice(_NAMES)
    wage, hours, weeks = rng.randint(9, 45), rng.randint(10, 40), rng.randint(2, 12)
    text = (
        f"{name} earns {wage} dollars per hour and works {hours} hours each week. "
        f"How many dollars does {name} earn in {weeks} weeks?"
    )
    return text, f"{wage} * {hours} * {weeks}", wage * hours * weeks


def _share_then_eat(rng: random.Random) -> _Problem:
    items = rng.choice(_ITEMS[:4])
    children, each = rng.randint(3, 12), rng.randint(10, 90)
    eaten = rng.randint(1, each - 1)
    total = children * each
    text = (
        f"{total} {items} are shared equally among {children} children. Each child then gives away {eaten} "
        f"of them. How many {items} does each child have left?"
    )
    return text, f"{total} / {children} - {eaten}", each - eaten


def _three_days_of_sales(rng: random.Random) -> _Problem:
    items = rng.choice(("loaves", "muffins", "pies", "cakes"))
    monday, tuesday, times = rng.randint(10, 150), rng.randint(10, 150), rng.randint(2, 5)
    text = (
        f"A bakery sold {monday} {items} on Monday and {tuesday} on Tuesday. On Wednesday it sold {times} "
        f"times as many as on Monday. How many {items} did it sell over the three days?"
    )
    return text, f"{monday} + {tuesday} + {times} * {monday}", monday + tuesday + times * monday


def _change_from_a_bill(rng: random.Random) -> _Problem:
    name, items = rng.choice(_NAMES), rng.choice(("notebooks", "tickets", "books", "plants"))
    count, price = rng.randint(2, 12), rng.randint(3, 40)
    bill = next(note for note in (50, 100, 200, 500) if note > count * price)
    text = (
        f"{name} buys {count} {items} that cost {price} dollars each and pays with {bill} dollars. "
        f"How many dollars of change does {name} get?"
    )
    return text, f"{bill} - {count} * {price}", bill - count * price


def _train_trip(rng: random.Random) -> _Problem:
    speed, hours, extra = rng.randint(40, 180), rng.randint(2, 9), rng.randint(10, 300)
    text = (
        f"A train travels at {speed} km per hour for {hours} hours and then another {extra} km. "
        "How many km does it travel in total?"
    )
    return text, f"{speed} * {hours} + {extra}", speed * hours + extra


def _half_then_more(rng: random.Random) -> _Problem:
    name = rng.choice(_NAMES)
    savings = 2 * rng.randint(20, 400)
    helmet = rng.randint(1, savings // 2 - 1)
    text = (
        f"{name} had {savings} dollars, spent half of it on a bike and then {helmet} dollars on a helmet. "
        f"How many dollars does {name} have left?"
    )
    return text, f"{savings} / 2 - {helmet}", savings // 2 - helmet


def _garden_rows(rng: random.Random) -> _Problem:
    name = rng.choice(_NAMES)
    rows, per_row = rng.randint(4, 30), rng.randint(5, 40)
    removed = rng.randint(1, rows * per_row - 1)
    planted = rng.randint(1, 99)
    text = (
        f"A garden has {rows} rows with {per_row} plants in each row. {name} removes {removed} plants and "
        f"then plants {planted} new ones. How many plants are in the garden now?"
    )
    return text, f"{rows} * {per_row} - {removed} + {planted}", rows * per_row - removed + planted


def _pages_left(rng: random.Random) -> _Problem:
    name = rng.choice(_NAMES)
    per_day, days = rng.randint(5, 40), rng.randint(2, 14)
    pages = per_day * days + rng.randint(1, 400)
    text = (
        f"A book has {pages} pages. {name} reads {per_day} pages a day for {days} days. "
        "How many pages are left to read?"
    )
    return text, f"{pages} - {per_day} * {days}", pages - per_day * days


WORD_PROBLEM_TEMPLATES: tuple[Callable[[random.Random], _Problem], ...] = (
    _buy_and_give,
    _boxes_and_leftovers,
    _weekly_wage,
    _share_then_eat,
    _three_days_of_sales,
    _change_from_a_bill,
    _train_trip,
    _half_then_more,
    _garden_rows,
    _pages_left,
)
"""Each template draws its numbers and returns ``(problem text, arithmetic expression, answer)``."""


def _easy_add(rng: random.Random) -> _Problem:
    name, items = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    return (
        f"{name} has {a} {items} and buys {b} more. How many {items} does {name} have now?",
        f"{a} + {b}",
        a + b,
    )


def _easy_subtract(rng: random.Random) -> _Problem:
    name, items = rng.choice(_NAMES), rng.choice(_ITEMS)
    a = rng.randint(5, 20)
    b = rng.randint(1, a - 1)
    text = f"{name} has {a} {items} and gives {b} to a friend. How many {items} does {name} have left?"
    return text, f"{a} - {b}", a - b


def _easy_multiply(rng: random.Random) -> _Problem:
    name, items = rng.choice(_NAMES), rng.choice(_ITEMS)
    bags, per_bag = rng.randint(2, 9), rng.randint(2, 9)
    text = f"{name} buys {bags} bags with {per_bag} {items} in each bag. How many {items} does {name} buy?"
    return text, f"{bags} * {per_bag}", bags * per_bag


EASY_WORD_PROBLEM_TEMPLATES: tuple[Callable[[random.Random], _Problem], ...] = (
    _easy_add,
    _easy_subtract,
    _easy_multiply,
)
"""One-step problems over numbers up to 20 (``difficulty="easy"``)."""

Difficulty = Literal["easy", "multi_step"]


def word_problems(
    num_prompts: int,
    seed: int,
    instruction: str = WORD_PROBLEM_INSTRUCTION,
    difficulty: Difficulty = "multi_step",
) -> list[dict]:
    """GSM8K-style arithmetic word problems with a numeric answer.

    ``difficulty="multi_step"``: ten templates (buying and giving, boxes, wages, sharing, sales,
    change, speed, halves, rows, pages), two or three steps each, mix ``+ - * /`` over one- to
    three-digit numbers; answers are non-negative integers up to about 20,000.
    ``difficulty="easy"``: one ``+``, ``-`` or ``*`` over numbers up to 20 (a small model's
    warm-up: untrained SmolLM2-135M-Instruct solves these greedily but not the multi-step ones).

    The prompt is the problem, a newline and ``instruction`` (by default asking for the answer in
    ``\\boxed{}``). Records also carry ``"expression"``, the arithmetic that gives the answer (a
    worked solution for checks and logs).

    Example::

        >>> record = word_problems(1, seed=0)[0]
        >>> print(record["prompt"])
        A train travels at 147 km per hour for 2 hours and then another 142 km. How many km does it travel in total?
        Give only the final answer, written as \\boxed{number}, e.g. \\boxed{42}.
        >>> record["answer"], record["expression"]
        ('436', '147 * 2 + 142')
        >>> word_problems(1, seed=0, difficulty="easy")[0]["expression"]
        '13 - 9'
    """
    templates = {"easy": EASY_WORD_PROBLEM_TEMPLATES, "multi_step": WORD_PROBLEM_TEMPLATES}.get(difficulty)
    if templates is None:
        raise ValueError(
            f"Task 'word_problems': difficulty={difficulty!r} is invalid; expected one of {list(get_args(Difficulty))}."
        )
    rng = random.Random(seed)
    records = []
    for _ in range(num_prompts):
        text, expression, answer = rng.choice(templates)(rng)
        records.append(
            {
                "prompt": f"{text}\n{instruction}",
                "answer": str(answer),
                "expression": expression,
                "task": "word_problems",
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
