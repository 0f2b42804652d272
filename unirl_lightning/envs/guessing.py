"""A higher/lower guessing game: find the record's secret number in a few turns, guided by the feedback.

Each turn the model guesses a whole number; the environment answers whether the secret is higher,
lower, or the guess is correct (which ends the episode). The reward needs several turns of
feedback: ``found_reward - turn_cost * (turns - 1)`` (at least 0) when the secret is found within
``max_turns``, 0 otherwise. A turn that is not a number costs the turn and gets an "invalid"
observation.

Syntax (``syntax="compact"``, for the tiny character-level model; string prompt)
    prompt ``?``; a guess is a turn that is just an integer (``"5"``); observations ``+`` (the secret
    is higher), ``-`` (lower), ``?`` (not a number). With the defaults (secret in 0..9,
    ``max_turns=4``) bisection always wins (4 = ceil(log2(10)) guesses), the whole episode is a few
    tokens (``?`` | ``4`` | ``+`` | ``7`` | ``-`` | ``6``), and the optimal policy is one short
    decision tree over the feedback so far: a tiny random-init model can learn it with RL.
Syntax (``syntax="words"``, for instruction-tuned models; chat-message prompt)
    the guess is the *last* integer in the turn (``"My guess is 50."``); observations ``higher``,
    ``lower``, ``Reply with one whole number.``.

``info`` of every step: ``guess`` (``None`` when invalid), ``feedback`` (``"higher"``, ``"lower"``,
``"correct"`` or ``"invalid"``), ``guesses`` and ``invalid_guesses`` so far.

Records: ``{"prompt": "?", "secret": 7, "low": 0, "high": 9, "answer": "7", ...}``;
:func:`guessing_records` generates them deterministically per seed, with held-out secrets that
never appear in training.
"""

from __future__ import annotations

import random
import re
from typing import Any, Literal

from unirl_lightning.envs.base import Environment, Observation, Split, StepResult, check_split, record_preview

__all__ = ["GuessingGameEnv", "GuessingSyntax", "guessing_prompt", "guessing_records", "parse_guess"]

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
    ) -> None:
        super().__init__(max_turns)
        if syntax not in _SYNTAXES:
            raise ValueError(f"GuessingGameEnv syntax={syntax!r} is invalid; expected one of {_SYNTAXES}.")
        if not found_reward > 0:
            raise ValueError(f"GuessingGameEnv found_reward={found_reward!r} is invalid; expected > 0.")
        if not turn_cost >= 0:
            raise ValueError(f"GuessingGameEnv turn_cost={turn_cost!r} is invalid; expected >= 0.")
        self.syntax: GuessingSyntax = syntax
        self.found_reward = float(found_reward)
        self.turn_cost = float(turn_cost)
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
        return prompt if self.syntax == "compact" else [{"role": "user", "content": prompt}]

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
            f"found_reward={self.found_reward}, turn_cost={self.turn_cost})"
        )


def _in_heldout(secret: int, low: int, heldout_every: int) -> bool:
    return (secret - low) % heldout_every == heldout_every - 1


def guessing_prompt(low: int, high: int, syntax: GuessingSyntax) -> str:
    """The prompt of a game on ``[low, high]``: ``"?"`` (compact) or an instruction (words)."""
    _check_syntax(syntax)
    if syntax == "compact":
        return "?"
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
    heldout_every: int = 5,
) -> list[dict[str, Any]]:
    """``num_prompts`` games with a secret drawn uniformly from the ``split``'s secrets in ``[low, high]``.

    The same arguments give the same records (a private ``random.Random(seed)``). Every
    ``heldout_every``-th secret (``(secret - low) % heldout_every == heldout_every - 1``: 4 and 9 for
    0..9) is held out and never drawn for ``"train"``. With the compact prompt ``"?"`` the policy
    never sees the secret, so the held-out split measures whether it learned to search rather
    than to recite.

    Returns records ``{"prompt", "secret", "low", "high", "answer": str(secret), "task": "guessing"}``.

    Example::

        >>> guessing_records(2, seed=0)
        [{'prompt': '?', 'secret': 6, 'low': 0, 'high': 9, 'answer': '6', 'task': 'guessing'}, ...]
    """
    check_split(split)
    _check_syntax(syntax)
    for name, value in (
        ("num_prompts", num_prompts),
        ("low", low),
        ("high", high),
        ("heldout_every", heldout_every),
    ):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"guessing_records {name}={value!r} is invalid; expected an int.")
    if num_prompts < 0:
        raise ValueError(f"guessing_records num_prompts={num_prompts!r} is invalid; expected an int >= 0.")
    if heldout_every < 2:
        raise ValueError(
            f"guessing_records heldout_every={heldout_every!r} is invalid; expected an int >= 2."
        )
    if high - low + 1 < heldout_every:
        raise ValueError(
            f"guessing_records low={low}, high={high} holds {high - low + 1} secrets; with "
            f"heldout_every={heldout_every} the held-out split would be empty: expected high - low + 1 >= heldout_every."
        )
    rng = random.Random(seed)
    prompt = guessing_prompt(low, high, syntax)
    records = []
    for _ in range(num_prompts):
        if split == "heldout":  # the k-th held-out secret is low + k * heldout_every + heldout_every - 1
            secret = (
                low + rng.randrange((high - low + 1) // heldout_every) * heldout_every + heldout_every - 1
            )
        else:
            secret = rng.randint(low, high)
            while _in_heldout(secret, low, heldout_every):
                secret = rng.randint(low, high)
        records.append(
            {
                "prompt": prompt,
                "secret": secret,
                "low": low,
                "high": high,
                "answer": str(secret),
                "task": "guessing",
            }
        )
    return records
