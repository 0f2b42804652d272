"""A higher/lower guessing game: find the record's secret number in a few turns, guided by the feedback.

Each turn the model guesses a whole number; the environment answers whether the secret is higher,
lower, or the guess is correct (which ends the episode). The reward needs several turns of
feedback: ``found_reward - turn_cost * (turns - 1)`` (at least 0) when the secret is found within
``max_turns``, 0 otherwise. A turn that is not a number costs the turn and gets an "invalid"
observation.

Syntax (``syntax="compact"``, for the tiny character-level model; string prompt)
    prompt ``?`` (one fixed range) or ``3,8?`` (the range stated); a guess is a turn that is just an
    integer (``"5"``); observations ``+`` (the secret is higher), ``-`` (lower), ``?`` (not a number).
    With the defaults (secret in 0..9, ``max_turns=4``) bisection always wins (4 = ceil(log2(10))
    guesses, mean reward 0.81; uniform random guessing: 0.30), and a whole episode is a few tokens
    (``?`` | ``4`` | ``+`` | ``7`` | ``-`` | ``6``). Sample one token per turn
    (``max_new_tokens=1``) so that every action is a guess: the optimal policy is then a depth-4
    decision tree over the feedback tokens so far. (A check with ``TinyCausalLM`` (64 wide, 2
    layers), a plain group-baseline policy gradient, 64 episodes per step, Adam 1e-3: mean
    reward 0.13 -> 0.56 in 500 steps, about a minute of CPU.)
Syntax (``syntax="words"``, for instruction-tuned models; chat-message prompt)
    the guess is the *last* integer in the turn (``"My guess is 50."``); observations ``higher``,
    ``lower``, ``Reply with one whole number.``. With ``example_game=True`` the chat opens with the
    rules as a system message and one short solved game (:data:`EXAMPLE_GAME`) before the record's
    prompt: a small instruction model (SmolLM2-135M-Instruct) given the bare prompt answers with
    prose in most turns (44 of 160 turns held a number, 1 of 32 games won; temperature 0.7, ranges in
    0..20, 5 turns); after the example 141 of 144 turns held a number and 8 of 32 games were won.

``info`` of every step: ``guess`` (``None`` when invalid), ``feedback`` (``"higher"``, ``"lower"``,
``"correct"`` or ``"invalid"``), ``guesses`` and ``invalid_guesses`` so far.

Records: ``{"prompt": "?", "secret": 7, "low": 0, "high": 9, "answer": "7", ...}``;
:func:`guessing_records` generates them deterministically per seed: one fixed range (prompt ``?``),
or varied ranges stated in the prompt (``3,8?``) with held-out ranges that never appear in training.
"""

from __future__ import annotations

import random
import re
from typing import Any, Literal

from unirl_lightning.envs.base import (
    Environment,
    Observation,
    Split,
    StepResult,
    check_split,
    in_heldout,
    record_preview,
)

__all__ = [
    "EXAMPLE_GAME",
    "GuessingGameEnv",
    "GuessingSyntax",
    "guessing_prompt",
    "guessing_records",
    "parse_guess",
]

GuessingSyntax = Literal["compact", "words"]
_SYNTAXES = ("compact", "words")
Feedback = Literal["higher", "lower", "correct", "invalid"]

_OBSERVATIONS: dict[str, dict[str, str]] = {
    "compact": {"higher": "+", "lower": "-", "invalid": "?"},
    "words": {"higher": "higher", "lower": "lower", "invalid": "Reply with one whole number."},
}
_MAX_GUESS_DIGITS = 18
_INTEGER_COMPACT = re.compile(rf"-?\d{{1,{_MAX_GUESS_DIGITS}}}")
_INTEGER_WORDS = re.compile(r"-?\d+")
_MAX_VARIED_RANGE = 200
_RULES = (
    "We play a number guessing game. Reply with one whole number and nothing else. "
    "I answer higher, lower or correct."
)
EXAMPLE_GAME: list[dict[str, str]] = [
    {"role": "user", "content": "New game: a whole number from 0 to 8. Your guess?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "higher"},
    {"role": "assistant", "content": "6"},
    {"role": "user", "content": "lower"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "correct"},
]
"""The solved game that ``GuessingGameEnv(syntax="words", example_game=True)`` shows before the real one."""


def _check_syntax(syntax: Any) -> None:
    if syntax not in _SYNTAXES:
        raise ValueError(f"syntax={syntax!r} is invalid; expected one of {_SYNTAXES}.")


def _int_field(record: dict[str, Any], key: str) -> int:
    if key not in record:
        raise ValueError(
            f"GuessingGameEnv needs record key {key!r} (an int); the record has keys {sorted(record)}: "
            f"{record_preview(record)}"
        )
    value = record[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"GuessingGameEnv record {key!r}={value!r} is invalid; expected an int.")
    return value


def parse_guess(assistant_text: str, syntax: GuessingSyntax) -> int | None:
    """The guessed integer, or ``None`` when the turn holds no valid guess (see the module docstring)."""
    if syntax == "compact":
        text = assistant_text.strip()
        return int(text) if _INTEGER_COMPACT.fullmatch(text) else None
    numbers = _INTEGER_WORDS.findall(assistant_text)
    if not numbers or len(numbers[-1].lstrip("-")) > _MAX_GUESS_DIGITS:
        return None
    return int(numbers[-1])


class GuessingGameEnv(Environment):
    """Higher/lower: find ``record["secret"]`` in ``[record["low"], record["high"]]`` within ``max_turns`` guesses.

    Args:
        max_turns: guesses per episode (4 suffice for 0..9 with bisection, 7 for 1..100).
        syntax: ``"compact"`` (``+``/``-``/``?`` observations, string prompt) or ``"words"``
            (``higher``/``lower``, chat-message prompt).
        found_reward: reward for finding the secret on the first guess.
        turn_cost: subtracted per extra guess, so faster search earns more (never below 0).
        example_game: ``words`` syntax only: open the chat with the rules (system message) and
            :data:`EXAMPLE_GAME`, for instruction models too small to follow the bare prompt.

    Example::

        env = GuessingGameEnv(max_turns=4)
        env.reset({"prompt": "?", "secret": 6, "low": 0, "high": 9})  # -> "?"
        env.step("4").observation  # -> "+"
        env.step("7").observation  # -> "-"
        env.step("6")  # -> StepResult(None, 0.8, True, {... "feedback": "correct" ...})
    """

    def __init__(
        self,
        max_turns: int = 4,
        syntax: GuessingSyntax = "compact",
        found_reward: float = 1.0,
        turn_cost: float = 0.1,
        example_game: bool = False,
    ) -> None:
        super().__init__(max_turns)
        if syntax not in _SYNTAXES:
            raise ValueError(f"GuessingGameEnv syntax={syntax!r} is invalid; expected one of {_SYNTAXES}.")
        if example_game and syntax != "words":
            raise ValueError(
                "GuessingGameEnv example_game=True needs syntax='words' (the example is chat messages)"
            )
        if not found_reward > 0:
            raise ValueError(f"GuessingGameEnv found_reward={found_reward!r} is invalid; expected > 0.")
        if not turn_cost >= 0:
            raise ValueError(f"GuessingGameEnv turn_cost={turn_cost!r} is invalid; expected >= 0.")
        self.syntax: GuessingSyntax = syntax
        self.found_reward = float(found_reward)
        self.turn_cost = float(turn_cost)
        self.example_game = bool(example_game)
        self.secret = 0
        self.guesses = 0
        self.invalid_guesses = 0

    def on_reset(self, record: dict[str, Any]) -> Observation:
        secret, low, high = (_int_field(record, key) for key in ("secret", "low", "high"))
        if not low <= secret <= high:
            raise ValueError(
                f"GuessingGameEnv record needs low <= secret <= high, got low={low}, secret={secret}, high={high}."
            )
        prompt = record.get("prompt", guessing_prompt(low, high, self.syntax))
        if not isinstance(prompt, str):
            raise ValueError(f"GuessingGameEnv record 'prompt' must be a str, got {type(prompt).__name__}.")
        self.secret = secret
        self.guesses = 0
        self.invalid_guesses = 0
        if self.syntax == "compact":
            return prompt
        opening = [{"role": "system", "content": _RULES}, *EXAMPLE_GAME] if self.example_game else []
        return [*opening, {"role": "user", "content": prompt}]

    def on_step(self, assistant_text: str) -> StepResult:
        guess = parse_guess(assistant_text, self.syntax)
        feedback: Feedback
        if guess is None:
            self.invalid_guesses += 1
            feedback = "invalid"
        else:
            self.guesses += 1
            feedback = "higher" if self.secret > guess else "lower" if self.secret < guess else "correct"
        info = {
            "guess": guess,
            "feedback": feedback,
            "guesses": self.guesses,
            "invalid_guesses": self.invalid_guesses,
        }
        if feedback == "correct":
            reward = max(0.0, self.found_reward - self.turn_cost * (self.turn - 1))
            return StepResult(None, reward, done=True, info=info)
        return StepResult(_OBSERVATIONS[self.syntax][feedback], 0.0, done=False, info=info)

    def __repr__(self) -> str:
        return (
            f"GuessingGameEnv(max_turns={self.max_turns}, syntax={self.syntax!r}, "
            f"found_reward={self.found_reward}, turn_cost={self.turn_cost}, example_game={self.example_game})"
        )


def guessing_prompt(low: int, high: int, syntax: GuessingSyntax, state_range: bool = True) -> str:
    """The prompt of a game on ``[low, high]``.

    ``compact``: ``"3,8?"``, or ``"?"`` with ``state_range=False`` (one fixed range, known to the policy
    only through training); ``words``: an instruction that always states the range.
    """
    _check_syntax(syntax)
    if syntax == "compact":
        return f"{low},{high}?" if state_range else "?"
    return (
        f"I picked a whole number from {low} to {high}. Guess it: reply with one number. After each guess "
        "I answer higher (the number is larger), lower (it is smaller) or correct."
    )


def guessing_records(
    num_prompts: int,
    seed: int = 0,
    split: Split = "train",
    low: int = 0,
    high: int = 9,
    syntax: GuessingSyntax = "compact",
    vary_range: bool = False,
    min_size: int = 2,
    heldout_percent: int = 20,
) -> list[dict[str, Any]]:
    """``num_prompts`` guessing games on ``[low, high]`` (or on sub-ranges of it), secret uniform in the range.

    The same arguments give the same records (a private ``random.Random(seed)``).

    * ``vary_range=False`` (default; the tiny-model setup): every record is the game on
      ``[low, high]``; the compact prompt is ``"?"``. All prompts are then the same, so no record can be
      held out: ``split="heldout"`` raises. Evaluate on ``split="train"`` with another seed (what
      generalises is the search policy, which never sees the secret). Holding out *secrets* instead
      would be unfair: training never rewards finding them, so no policy could know they exist.
    * ``vary_range=True``: each record is the game on a sub-range ``[a, b]`` of ``[low, high]`` with at
      least ``min_size`` numbers, stated in the prompt (compact ``"3,8?"``); a range belongs to the
      held-out split by a stable hash of ``"a,b"`` (``heldout_percent`` percent of the ranges), so no
      held-out prompt ever appears in training, and the held-out split measures search on unseen ranges.

    Returns records ``{"prompt", "secret", "low", "high", "answer": str(secret), "task": "guessing"}``
    (``low``/``high``: the record's own range).

    Example::

        >>> guessing_records(2, seed=0)
        [{'prompt': '?', 'secret': 6, 'low': 0, 'high': 9, 'answer': '6', 'task': 'guessing'}, ...]
        >>> guessing_records(1, seed=0, vary_range=True)
        [{'prompt': '3,9?', 'secret': 9, 'low': 3, 'high': 9, 'answer': '9', 'task': 'guessing'}]
    """
    check_split(split)
    _check_syntax(syntax)
    for name, value in (("num_prompts", num_prompts), ("low", low), ("high", high), ("min_size", min_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"guessing_records {name}={value!r} is invalid; expected an int.")
    if num_prompts < 0:
        raise ValueError(f"guessing_records num_prompts={num_prompts!r} is invalid; expected an int >= 0.")
    if high < low:
        raise ValueError(f"guessing_records low={low}, high={high} is an empty range; expected low <= high.")
    rng = random.Random(seed)
    if not vary_range:
        if split == "heldout":
            raise ValueError(
                "guessing_records split='heldout' needs vary_range=True: with one fixed range every prompt is the "
                "same, so no record can be held out; evaluate on split='train' with another seed instead."
            )
        prompt = guessing_prompt(low, high, syntax, state_range=False)
        return [_game(prompt, rng.randint(low, high), low, high) for _ in range(num_prompts)]
    if not 1 <= heldout_percent <= 99:
        raise ValueError(f"guessing_records heldout_percent={heldout_percent!r} is invalid; expected 1..99.")
    if not 1 <= min_size <= high - low + 1 or high - low + 1 > _MAX_VARIED_RANGE:
        raise ValueError(
            f"guessing_records vary_range=True needs 1 <= min_size <= high - low + 1 <= {_MAX_VARIED_RANGE}, got "
            f"low={low}, high={high}, min_size={min_size}."
        )
    ranges = [
        (a, b)
        for a in range(low, high + 1)
        for b in range(a + min_size - 1, high + 1)
        if in_heldout(f"{a},{b}", heldout_percent) == (split == "heldout")
    ]
    if not ranges:
        raise ValueError(
            f"guessing_records: no sub-range of [{low}, {high}] with min_size={min_size} falls in split {split!r} "
            f"(heldout_percent={heldout_percent}); widen the range or lower min_size."
        )
    records = []
    for _ in range(num_prompts):
        a, b = rng.choice(ranges)
        records.append(_game(guessing_prompt(a, b, syntax), rng.randint(a, b), a, b))
    return records


def _game(prompt: str, secret: int, low: int, high: int) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "secret": secret,
        "low": low,
        "high": high,
        "answer": str(secret),
        "task": "guessing",
    }
