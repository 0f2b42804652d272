"""GSM8K-style arithmetic word problems for a pretrained instruct model (the built-in task
``word_problems``): templates that draw their numbers from a private ``random.Random(seed)``, each
giving the problem text, the arithmetic that solves it and its answer."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Literal, get_args

__all__ = [
    "EASY_WORD_PROBLEM_TEMPLATES",
    "WORD_PROBLEM_INSTRUCTION",
    "WORD_PROBLEM_TEMPLATES",
    "word_problems",
]


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
