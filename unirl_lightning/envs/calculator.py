"""A calculator tool environment: the model calls a safe arithmetic evaluator, then gives a final answer.

Syntax (``syntax="xml"``, for instruction-tuned models; the initial observation is chat messages)
    * tool call: ``<calc>12*7+3</calc>`` -> observation ``<result>87</result>``
      (or ``<error>division by zero</error>`` for an expression the calculator refuses);
    * final answer: ``<answer>87</answer>`` (the inner text goes to math-verify, so ``\\boxed{87}``
      or ``87.0`` inside the tags are fine too) -> ``done``, reward from math-verify against the
      record's ``answer``;
    * a turn with neither -> ``<error>...</error>`` naming the syntax, and the episode goes on.
    An ``<answer>`` ends the episode even if the turn also holds a call; only the first call of a
    turn is evaluated. A closing tag cut off by a stop string (``stop=("</calc>", "</answer>")`` with
    an engine that strips stop strings) is not needed: an unclosed tag extends to the end of the turn.

Syntax (``syntax="compact"``, for the tiny character-level model; the initial observation is a string)
    Only the characters of :data:`~unirl_lightning.models.causal_lm.CHAR_VOCAB` (``0-9 + - * = space ? . ,``):
    * prompt ``37*12+5?``;
    * tool call: a turn ending in ``=``, e.g. ``37*12=`` -> observation ``444,``;
    * final answer: a turn that is just a number, e.g. ``449`` -> ``done``, scored as above;
    * anything else, or an expression the calculator refuses -> observation ``?,``.
    * with ``equals_key=True``, a turn that is just ``=`` evaluates the question as typed (the
      record's ``expression``: the calculator's equals key), so a small model can reach the tool
      without copying the expression first.
    A solved episode reads ``37*12+5?`` | ``37*12+5=`` | ``449,`` | ``449``: two copies, which a
    small model can plausibly learn by RL; division and parentheses are not in the tiny vocabulary.
    Model turns end with EOS; do not make ``=`` a stop string that the engine strips from the text.

The evaluator is :func:`~unirl_lightning.envs.arithmetic.safe_eval` (exact arithmetic, never ``eval``);
a refused expression raises :class:`~unirl_lightning.envs.arithmetic.CalculatorError`, which the
environment turns into an error observation, never an exception.

``info`` of every step counts ``tool_calls``, ``tool_errors`` (refused expressions) and
``format_errors`` (turns with neither a call nor an answer) so far in the episode.

Records: ``{"prompt": "What is 37*12+5?", "answer": "449", ...}``; :func:`calculator_records`
generates multi-digit multiplications deterministically per seed, with a held-out split that never
overlaps the training split.
"""

from __future__ import annotations

import functools
import random
import re
from typing import Any, Literal

from unirl_lightning.envs.arithmetic import CalculatorError, format_number, safe_eval
from unirl_lightning.envs.base import (
    Environment,
    Observation,
    Split,
    StepResult,
    check_split,
    in_heldout,
    record_preview,
)
from unirl_lightning.rewards.base import Reward
from unirl_lightning.rewards.callable import resolve_reward
from unirl_lightning.rewards.math import MathVerifyReward
from unirl_lightning.rewards.scoring import score_batch

__all__ = [
    "CALCULATOR_INSTRUCTIONS",
    "CalculatorEnv",
    "CalculatorError",
    "CalculatorSyntax",
    "calculator_records",
    "digit_credit",
    "format_number",
    "parse_calculator_turn",
    "safe_eval",
]

CalculatorSyntax = Literal["xml", "compact"]
_SYNTAXES = ("xml", "compact")

CALCULATOR_INSTRUCTIONS = (
    "You can use a calculator. To compute an expression, write <calc>expression</calc> using only numbers, "
    "+ - * / and parentheses, then stop; the result comes back as <result>value</result>. "
    "When you know the final answer, write <answer>number</answer>."
)
"""The system message of the ``xml`` syntax."""

_CALL_XML = re.compile(r"<calc>(.*?)(?:</calc>|\Z)", re.DOTALL)
_ANSWER_XML = re.compile(r"<answer>(.*?)(?:</answer>|\Z)", re.DOTALL)
_NUMBER_COMPACT = re.compile(r"-?\d+(?:\.\d+)?")


def parse_calculator_turn(
    assistant_text: str, syntax: CalculatorSyntax
) -> tuple[Literal["answer", "call", "none"], str]:
    """Classify one model turn: ``("answer", text)``, ``("call", expression)`` or ``("none", "")``.

    See the module docstring for both syntaxes; an answer takes precedence over a call.

    Example::

        >>> parse_calculator_turn("let me see <calc>37*12</calc>", "xml")
        ('call', '37*12')
        >>> parse_calculator_turn("449", "compact")
        ('answer', '449')
    """
    if syntax == "xml":
        answer = _ANSWER_XML.search(assistant_text)
        if answer:
            return "answer", answer.group(1).strip()
        call = _CALL_XML.search(assistant_text)
        if call:
            return "call", call.group(1).strip()
        return "none", ""
    if syntax == "compact":
        text = assistant_text.strip()
        if _NUMBER_COMPACT.fullmatch(text):
            return "answer", text
        if text.endswith("="):
            return "call", text[:-1].strip()
        return "none", ""
    raise ValueError(f"syntax={syntax!r} is invalid; expected one of {_SYNTAXES}.")


class CalculatorEnv(Environment):
    """Multi-turn arithmetic with a calculator tool; reward from math-verify on the final answer.

    The episode ends at the first final answer (reward: the ``reward``'s score of the answer text
    against the record, 1.0/0.0 with math-verify) or after ``max_turns`` turns without one (reward 0).
    The syntax and the observations are described in :mod:`unirl_lightning.envs.calculator`.

    Args:
        max_turns: model turns per episode (e.g. 2 for "call, then answer" on ``a*b+c``).
        syntax: ``"xml"`` (``<calc>``/``<answer>`` tags, chat-message prompt) or ``"compact"`` (tiny
            character vocabulary, string prompt).
        reward: scores the final answer text against the record (``reward([answer], [record])``);
            default :class:`~unirl_lightning.rewards.MathVerifyReward` on ``answer_key``. A string is
            the import path of a per-sample function ``fn(answer_text, record) -> float``.
        answer_key: record key of the reference answer (checked at ``reset``).
        max_expression_chars: longest expression the calculator evaluates.
        max_magnitude: largest absolute value of any number the calculator handles.
        decimals: decimal places of non-integer results.
        equals_key: ``compact`` syntax only: a turn that is just ``=`` calls the calculator on the
            record's ``expression`` (see the module docstring).
        tool_credit: shaping for small models: a wrong final answer given after a tool call whose
            result *was* the right answer earns :func:`digit_credit` (up to 0.5: credit for copying
            the result) instead of 0; otherwise only an exact answer scores. (Credit after any
            successful call was gamed: a tiny model learned to call the tool on a constant and
            answer that constant.)
        call_credit: shaping for small models, with ``tool_credit``: the least reward of a numeric
            final answer given after a tool call that returned the right answer (e.g. 0.1), so that
            the useful call itself is worth learning before any digit is copied; 0 (default) = off.

    Example::

        env = CalculatorEnv(max_turns=3)
        env.reset({"prompt": "What is 37*12+5?", "answer": "449"})
        env.step("<calc>37*12+5</calc>").observation  # -> "<result>449</result>"
        env.step("<answer>449</answer>").reward  # -> 1.0 (done)

        # YAML
        # env:
        #   class_path: unirl_lightning.envs.CalculatorEnv
        #   init_args: {max_turns: 3, syntax: compact}
    """

    def __init__(
        self,
        max_turns: int = 4,
        syntax: CalculatorSyntax = "xml",
        reward: Reward | str | None = None,
        answer_key: str = "answer",
        max_expression_chars: int = 100,
        max_magnitude: int = 10**15,
        decimals: int = 6,
        equals_key: bool = False,
        tool_credit: bool = False,
        call_credit: float = 0.0,
    ) -> None:
        super().__init__(max_turns)
        if syntax not in _SYNTAXES:
            raise ValueError(f"CalculatorEnv syntax={syntax!r} is invalid; expected one of {_SYNTAXES}.")
        if equals_key and syntax != "compact":
            raise ValueError("CalculatorEnv equals_key=True needs syntax='compact' (a bare '=' turn)")
        for name, value, low, high in (
            ("max_expression_chars", max_expression_chars, 1, 1000),
            ("max_magnitude", max_magnitude, 1, 10**100),
            ("decimals", decimals, 0, 30),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(
                    f"CalculatorEnv {name}={value!r} is invalid; expected an int in [{low}, {high}]."
                )
        if not (isinstance(call_credit, (int, float)) and 0.0 <= call_credit <= 0.5):
            raise ValueError(
                f"CalculatorEnv call_credit={call_credit!r} is invalid; expected a number in [0, 0.5]."
            )
        if call_credit and not tool_credit:
            raise ValueError(
                "CalculatorEnv call_credit needs tool_credit=True (it is a floor of the tool credit)"
            )
        self.syntax: CalculatorSyntax = syntax
        self.reward = _math_reward(answer_key) if reward is None else resolve_reward(reward)
        self.answer_key = answer_key
        self.max_expression_chars = max_expression_chars
        self.max_magnitude = max_magnitude
        self.decimals = decimals
        self.equals_key = equals_key
        self.tool_credit = tool_credit
        self.call_credit = float(call_credit)
        self.tool_calls = 0
        self.tool_errors = 0
        self.format_errors = 0
        self.answer_seen = False

    def on_reset(self, record: dict[str, Any]) -> Observation:
        for key in ("prompt", self.answer_key) + (("expression",) if self.equals_key else ()):
            if key not in record:
                raise ValueError(
                    f"CalculatorEnv needs record key {key!r}; the record has keys {sorted(record)}: "
                    f"{record_preview(record)}"
                )
        prompt = record["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"CalculatorEnv record 'prompt' must be a str, got {type(prompt).__name__}.")
        self.tool_calls = self.tool_errors = self.format_errors = 0
        self.answer_seen = False  # a tool call returned the reference answer (tool_credit)
        if self.syntax == "compact":
            return prompt
        return [{"role": "system", "content": CALCULATOR_INSTRUCTIONS}, {"role": "user", "content": prompt}]

    def on_step(self, assistant_text: str) -> StepResult:
        kind, payload = parse_calculator_turn(assistant_text, self.syntax)
        if kind == "answer":
            reward = score_batch(self.reward, [payload], [self.record])[0]
            if self.tool_credit and reward < 1.0 and self.answer_seen:
                # the reward above already judged the answer: only the partial credit is added here
                credit = 0.5 * _position_match(payload, str(self.record[self.answer_key]))
                reward = max(reward, credit, self.call_credit)
            return StepResult(None, reward, done=True, info={**self._counts(), "answer": payload})
        if kind == "call":
            self.tool_calls += 1
            if self.equals_key and not payload:
                payload = self.record["expression"]
            try:
                value = safe_eval(payload, self.max_expression_chars, self.max_magnitude)
            except CalculatorError as err:
                self.tool_errors += 1
                return StepResult(self._error(str(err)), info={**self._counts(), "expression": payload})
            result = format_number(value, self.decimals)
            self.answer_seen = self.answer_seen or result == str(self.record[self.answer_key]).strip()
            observation = f"{result}," if self.syntax == "compact" else f"<result>{result}</result>"
            return StepResult(observation, info={**self._counts(), "expression": payload, "result": result})
        self.format_errors += 1
        message = "write <calc>expression</calc> to compute, or <answer>number</answer> to finish"
        return StepResult(self._error(message), info=self._counts())

    def _error(self, message: str) -> str:
        return "?," if self.syntax == "compact" else f"<error>{message}</error>"

    def _counts(self) -> dict[str, int]:
        return {
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "format_errors": self.format_errors,
        }

    def __repr__(self) -> str:
        return f"CalculatorEnv(max_turns={self.max_turns}, syntax={self.syntax!r}, reward={self.reward!r})"


def digit_credit(answer_text: str, record: dict[str, Any], answer_key: str = "answer") -> float:
    """A shaped score for the final answer: 1.0 when math-verify accepts it, otherwise half the
    fraction of digit positions that match the reference (left-aligned, over the longer of the two),
    so a model that copies part of a tool result already earns something (``CalculatorEnv(tool_credit=True)``
    uses it after a tool call that returned the right answer).

    >>> digit_credit("3711", {"answer": "3711"}), digit_credit("3719", {"answer": "3711"}), digit_credit("", {"answer": "3711"})
    (1.0, 0.375, 0.0)
    """
    if score_batch(_math_reward(answer_key), [answer_text], [record])[0] == 1.0:
        return 1.0
    return 0.5 * _position_match(answer_text, str(record[answer_key]))


@functools.cache
def _math_reward(answer_key: str) -> MathVerifyReward:
    """One math reward per answer key and process: environments built per episode share its cache."""
    return MathVerifyReward(answer_key=answer_key)


def _position_match(answer_text: str, reference: str) -> float:
    """The fraction of left-aligned character positions where ``answer_text`` (stripped) and
    ``reference`` agree, over the longer of the two (0 when both are empty)."""
    given = answer_text.strip()
    width = max(len(given), len(reference))
    return sum(a == b for a, b in zip(given, reference)) / width if width else 0.0


def calculator_records(
    num_prompts: int,
    seed: int = 0,
    split: Split = "train",
    syntax: CalculatorSyntax = "xml",
    digits: int = 2,
    heldout_percent: int = 10,
) -> list[dict[str, Any]]:
    """``num_prompts`` problems ``a*b+c`` / ``a*b-c`` (``a``, ``b`` with ``digits`` digits, ``c`` in 1..99;
    with ``digits=1``, ``c`` in 1..9).

    The same arguments give the same records (a private ``random.Random(seed)``). Every expression
    belongs to exactly one split, by a stable hash of the expression (``heldout_percent`` percent
    are held out), so no ``"heldout"`` record ever appears in ``"train"``, whatever the seeds. The
    problems need the tool: the products have ``2 * digits - 1`` or more digits. ``digits=1`` (answers
    of one or two digits, 1,458 problems in all) is for tiny models learning the tool protocol: the
    result to copy is short, and the held-out problems still need the tool.

    Returns records ``{"prompt", "answer", "expression", "task": "calculator"}``; the prompt is
    ``"What is 37*12+5?"`` (``xml``) or ``"37*12+5?"`` (``compact``).

    Example::

        >>> calculator_records(1, seed=0, syntax="compact")
        [{'prompt': '59*63-6?', 'answer': '3711', 'expression': '59*63-6', 'task': 'calculator'}]
    """
    check_split(split)
    if syntax not in _SYNTAXES:
        raise ValueError(f"syntax={syntax!r} is invalid; expected one of {_SYNTAXES}.")
    for name, value, low, high in (
        ("num_prompts", num_prompts, 0, 10**7),
        ("digits", digits, 1, 6),
        ("heldout_percent", heldout_percent, 1, 99),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ValueError(
                f"calculator_records {name}={value!r} is invalid; expected an int in [{low}, {high}]."
            )
    rng = random.Random(seed)
    want_heldout = split == "heldout"
    records: list[dict[str, Any]] = []
    while len(records) < num_prompts:
        a = rng.randrange(10 ** (digits - 1), 10**digits)
        b = rng.randrange(10 ** (digits - 1), 10**digits)
        c = rng.randrange(1, 10 ** min(digits, 2))
        operator = rng.choice("+-")
        expression = f"{a}*{b}{operator}{c}"
        if in_heldout(expression, heldout_percent) != want_heldout:
            continue
        answer = a * b + c if operator == "+" else a * b - c
        prompt = f"{expression}?" if syntax == "compact" else f"What is {expression}?"
        records.append(
            {"prompt": prompt, "answer": str(answer), "expression": expression, "task": "calculator"}
        )
    return records
