"""The environment contract for agentic multi-turn RL: ``reset(record)`` then ``step(text)`` until done.

Who calls it
    A rollout coordinator inside a rollout worker (a Ray actor), many episodes at once, and tests.
    The coordinator builds one environment per episode from an
    :class:`~unirl_lightning.envs.spec.EnvSpec`, calls :meth:`Environment.reset` once, then
    alternates: generate the model's turn, :meth:`Environment.step` with its decoded text, append the
    returned observation as the next user/tool turn, until ``done``. It calls them through
    :func:`safe_reset` / :func:`safe_step`, which turn an environment's crash into an
    :class:`EnvStepError` naming the environment and the record.

The contract
    ``reset(record, seed=0) -> str | list[dict]``
        Start an episode on a prompt record (``{"prompt": ..., **task_keys}``) and return the initial
        observation: a prompt string (raw text, no chat template) or chat messages
        ``[{"role": ..., "content": ...}, ...]`` (rendered with the policy's chat template). It
        re-initialises every per-episode field, so one instance may run episodes one after another;
        an instance is never shared by two live episodes (instances share no mutable state).
    ``step(assistant_text) -> StepResult(observation, reward, done, info)``
        One model turn, decoded to text. ``observation`` is the text to append as the next
        user/tool turn (role :attr:`Environment.observation_role`); it is a ``str`` whenever ``done`` is
        False, and ignored once ``done`` is True (no model turn follows). ``reward`` is this step's
        reward; an episode's return is the sum over its steps (the built-in environments pay
        everything on the last step). ``info`` is a plain dict for logs; the base class sets
        ``info["turn"]`` (1-based) and ``info["truncated"]``.
    Turn limit
        After ``max_turns`` steps the episode ends even if the environment would go on: the last
        result gets ``done=True``, ``info["truncated"]=True`` and reward :meth:`Environment.on_turn_limit`
        (default: the step's own reward, 0 for the built-ins: no answer, no reward).
    Determinism
        The same record, seed and assistant texts give the same observations, rewards and infos. An
        environment's only randomness is ``self.rng``, the ``random.Random(seed)`` made by ``reset``;
        never the global RNG, the clock or a hash of a ``str`` (salted per process).
    Pure Python, picklable
        Instances and specs cross process boundaries (driver -> Ray workers): attributes are plain
        data (no open files, sockets, locks, lambdas, models). Constructors are cheap and free of
        side effects (the driver builds one at parse time to validate its arguments); per-episode
        work belongs in ``reset``.

Writing an environment
    Subclass :class:`Environment`, call ``super().__init__(max_turns)``, implement
    :meth:`~Environment.on_reset` and :meth:`~Environment.on_step`, optionally override
    :meth:`~Environment.on_turn_limit`. The base class keeps the turn count, the turn limit, the
    episode state and the checks of this contract.

Record generators
    A built-in environment comes with ``<name>_records(num_prompts, seed=0, split="train", **options)
    -> list[dict]``: the same arguments give the same records (a private ``random.Random(seed)``),
    and the ``"train"`` and ``"heldout"`` splits are disjoint whatever the seeds (each problem belongs
    to one split by a rule on the problem itself, not on the seed).

What raises
    ``RuntimeError`` (:class:`EpisodeStateError`) and ``TypeError`` for misuse by the caller:
    ``step`` before ``reset``, after ``done`` or after a step raised; a non-``str`` assistant text;
    a non-``dict`` record. ``TypeError`` / ``ValueError`` for an environment whose hooks break the
    contract (wrong result type, non-finite reward, no observation while not done). The hooks' own
    exceptions pass through :meth:`~Environment.step` unchanged; :func:`safe_reset` /
    :func:`safe_step` wrap every environment exception (not caller misuse, not ``KeyboardInterrupt``)
    in :class:`EnvStepError`.

This module imports only the standard library.
"""

from __future__ import annotations

import hashlib
import math
import random
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

__all__ = [
    "Environment",
    "EnvStepError",
    "Episode",
    "EpisodeStateError",
    "Observation",
    "Split",
    "StepResult",
    "check_split",
    "in_heldout",
    "run_episode",
    "safe_reset",
    "safe_step",
]

Observation = str | list[dict[str, Any]]
"""An initial observation: a raw prompt string, or chat messages ``[{"role", "content"}, ...]``."""

Split = Literal["train", "heldout"]
"""Which side of a record generator's disjoint train / held-out partition to draw from."""
_SPLITS = ("train", "heldout")

_RECORD_PREVIEW_CHARS = 200
_EpisodeState = Literal["idle", "live", "done", "failed"]


@dataclass(frozen=True)
class StepResult:
    """What :meth:`Environment.step` returns for one model turn.

    Attributes:
        observation: text appended as the next user/tool turn; a ``str`` while the episode goes on,
            usually ``None`` once ``done`` (and ignored then).
        reward: this step's reward (finite); the episode's return is the sum over its steps.
        done: the episode is over (answered, solved, failed for good, or hit ``max_turns``).
        info: plain data for logs (tool-call counts, the parsed guess, ...); ``"turn"`` and
            ``"truncated"`` are set by the base class.
    """

    observation: str | None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class EpisodeStateError(RuntimeError):
    """The caller broke the episode protocol: ``step`` before ``reset``, after ``done`` or after a crash."""


def check_split(split: Any) -> None:
    """Raise ``ValueError`` unless ``split`` is ``"train"`` or ``"heldout"``."""
    if split not in _SPLITS:
        raise ValueError(f"split={split!r} is invalid; expected one of {_SPLITS}.")


def in_heldout(key: str, heldout_percent: int) -> bool:
    """Whether the problem named ``key`` belongs to the held-out split (``heldout_percent`` percent of keys).

    Decided by the problem alone, stable across processes and Python versions (sha256, not the
    salted ``hash``), so no seed can put a problem in both splits.
    """
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 100
    return bucket < heldout_percent


def record_preview(record: Any, limit: int = _RECORD_PREVIEW_CHARS) -> str:
    """``repr(record)`` cut to ``limit`` characters (with ``...``), for error messages and logs."""
    text = repr(record)
    return text if len(text) <= limit else text[:limit] + "..."


class EnvStepError(RuntimeError):
    """An environment raised in ``reset`` or ``step``; names the environment, the phase, the turn and the record.

    Raised by :func:`safe_reset` / :func:`safe_step` with the original exception chained as
    ``__cause__`` (``raise ... from err``). It pickles (Ray ships it from the worker to the driver)
    with every attribute; the chained exception itself does not travel, so its type, message and
    formatted traceback are kept as strings.

    Attributes:
        env_class: the environment's class name, e.g. ``"CalculatorEnv"``.
        phase: ``"reset"`` or ``"step"``.
        turn: the 1-based turn that raised (0 for ``reset``).
        record: the record, as a ``repr`` cut to 200 characters.
        cause: ``"ExceptionType: message"`` of the original exception.
        cause_traceback: the original exception's formatted traceback.

    A coordinator either counts it and ends that episode (e.g. dropping its group), or stops the
    drive cleanly and re-raises it on the driver.
    """

    def __init__(
        self, env_class: str, phase: str, turn: int, record: str, cause: str, cause_traceback: str = ""
    ) -> None:
        self.env_class = env_class
        self.phase = phase
        self.turn = turn
        self.record = record
        self.cause = cause
        self.cause_traceback = cause_traceback
        where = "reset" if phase == "reset" else f"step (turn {turn})"
        super().__init__(f"environment {env_class} raised in {where}: {cause}; record: {record}")

    def __reduce__(self) -> tuple[Any, ...]:
        arguments = (self.env_class, self.phase, self.turn, self.record, self.cause, self.cause_traceback)
        return (type(self), arguments)

    @classmethod
    def wrap(cls, env: Environment, phase: str, error: BaseException, record: Any) -> EnvStepError:
        """The error for ``error`` raised by ``env`` in ``phase`` on ``record`` (chain it with ``from``)."""
        return cls(
            env_class=type(env).__name__,
            phase=phase,
            turn=env.turn if phase == "step" else 0,
            record=record_preview(record),
            cause=f"{type(error).__name__}: {error}",
            cause_traceback="".join(traceback.format_exception(type(error), error, error.__traceback__)),
        )


def _check_max_turns(owner: str, max_turns: Any) -> int:
    if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
        raise ValueError(f"{owner} max_turns={max_turns!r} is invalid; expected an int >= 1.")
    return max_turns


class Environment:
    """Base class of multi-turn environments: one episode at a time, ``reset`` then ``step`` until done.

    The contract is in the module docstring (:mod:`unirl_lightning.envs.base`). Subclasses implement
    :meth:`on_reset` and :meth:`on_step` and may override :meth:`on_turn_limit`; they read the
    episode through :attr:`record`, :attr:`turn` and :attr:`rng`.

    Args:
        max_turns: model turns (``step`` calls) per episode; the ``max_turns``-th step always ends it.

    Example::

        class EchoEnv(Environment):
            def on_reset(self, record):
                return record["prompt"]

            def on_step(self, assistant_text):
                solved = assistant_text.strip() == self.record["answer"]
                return StepResult("again" if not solved else None, float(solved), done=solved)

        env = EchoEnv(max_turns=2)
        env.reset({"prompt": "say 7", "answer": "7"})  # -> "say 7"
        env.step("8")  # -> StepResult("again", 0.0, False, {"turn": 1, "truncated": False})
        env.step("7")  # -> StepResult(None, 1.0, True, {"turn": 2, "truncated": False})
    """

    observation_role: ClassVar[str] = "user"
    """Chat role of the observations ``step`` returns (``"user"``, or ``"tool"`` for native tool calling)."""

    # Per-episode state; ``reset`` gives every instance its own (class values are immutable defaults).
    _state: _EpisodeState = "idle"
    _record: dict[str, Any] | None = None
    _turn: int = 0
    _total_reward: float = 0.0

    def __init__(self, max_turns: int = 4) -> None:
        self.max_turns = _check_max_turns(type(self).__name__, max_turns)
        self.rng = random.Random(0)

    # -- called by the coordinator ----------------------------------------------------------------
    def reset(self, record: dict[str, Any], seed: int = 0) -> Observation:
        """Start an episode on ``record``; returns the initial observation (see the module docstring)."""
        if not isinstance(record, dict):
            raise TypeError(
                f"{type(self).__name__}.reset needs a prompt record dict, got {type(record).__name__} "
                f"{record_preview(record)}"
            )
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"{type(self).__name__}.reset seed={seed!r} is invalid; expected an int.")
        self._state = "idle"
        self._record = dict(record)  # a copy: the environment never mutates the caller's record
        self._turn = 0
        self._total_reward = 0.0
        self.rng = random.Random(seed)
        observation = self.on_reset(self._record)
        self._check_initial_observation(observation)
        self._state = "live"
        return observation

    def step(self, assistant_text: str) -> StepResult:
        """Play one model turn; returns the observation to append, this step's reward, ``done`` and ``info``."""
        self._check_can_step(assistant_text)
        self._turn += 1
        try:
            result = self._checked(self.on_step(assistant_text), "on_step")
            truncated = not result.done and self._turn >= self.max_turns
            if truncated:
                reward = self._finite_reward(self.on_turn_limit(result), "on_turn_limit")
                result = replace(result, reward=reward, done=True)
        except BaseException:
            self._state = "failed"
            raise
        result = replace(result, info={**result.info, "turn": self._turn, "truncated": truncated})
        self._total_reward += result.reward
        if result.done:
            self._state = "done"
        return result

    @property
    def record(self) -> dict[str, Any]:
        """The record of the current episode (a copy of the one given to ``reset``)."""
        if self._record is None:
            raise EpisodeStateError(f"{type(self).__name__} has no record yet: call reset(record) first.")
        return self._record

    @property
    def turn(self) -> int:
        """Model turns played in this episode (inside ``on_step``: the 1-based number of this turn)."""
        return self._turn

    @property
    def done(self) -> bool:
        """True once a step returned ``done=True`` (until the next ``reset``)."""
        return self._state == "done"

    @property
    def total_reward(self) -> float:
        """Sum of the rewards of this episode's steps so far (the episode's return once ``done``)."""
        return self._total_reward

    # -- implemented by subclasses ----------------------------------------------------------------
    def on_reset(self, record: dict[str, Any]) -> Observation:
        """Initialise this episode from ``record`` (a private copy) and return the initial observation."""
        raise NotImplementedError(f"{type(self).__name__} must implement on_reset(record).")

    def on_step(self, assistant_text: str) -> StepResult:
        """React to one model turn; ``self.turn`` is its 1-based number. The base class applies the turn limit."""
        raise NotImplementedError(f"{type(self).__name__} must implement on_step(assistant_text).")

    def on_turn_limit(self, last: StepResult) -> float:
        """The reward of the step that hits ``max_turns`` without finishing; default: that step's own reward."""
        return last.reward

    # -- contract checks --------------------------------------------------------------------------
    def _check_can_step(self, assistant_text: Any) -> None:
        name = type(self).__name__
        if self._state != "live":
            why = {
                "idle": "before reset(record)",
                "done": f"after the episode ended (done at turn {self._turn}); call reset(record) for a new one",
                "failed": "after a previous step raised; call reset(record) for a new episode",
            }[self._state]
            raise EpisodeStateError(f"{name}.step called {why}.")
        if not isinstance(assistant_text, str):
            raise TypeError(
                f"{name}.step needs the model's turn as decoded text (str), got {type(assistant_text).__name__}."
            )

    def _check_initial_observation(self, observation: Any) -> None:
        is_messages = (
            isinstance(observation, list)
            and bool(observation)
            and all(
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
                for message in observation
            )
        )
        if not (isinstance(observation, str) or is_messages):
            raise TypeError(
                f"{type(self).__name__}.on_reset returned {record_preview(observation)}; expected a prompt str "
                "or a non-empty list of chat messages {'role': str, 'content': str}."
            )

    def _finite_reward(self, reward: Any, hook: str) -> float:
        try:
            value = float(reward)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value):
            raise ValueError(
                f"{type(self).__name__}.{hook} returned reward {reward!r}; expected a finite float."
            )
        return value

    def _checked(self, result: Any, hook: str) -> StepResult:
        name = type(self).__name__
        if not isinstance(result, StepResult):
            raise TypeError(f"{name}.{hook} returned {type(result).__name__}; expected a StepResult.")
        if not isinstance(result.done, bool):
            raise TypeError(f"{name}.{hook} returned done={result.done!r}; expected a bool.")
        if not result.done and not isinstance(result.observation, str):
            raise TypeError(
                f"{name}.{hook} returned observation={result.observation!r} with done=False; an episode that "
                "goes on needs the str to append as the next turn."
            )
        if not isinstance(result.info, dict):
            raise TypeError(f"{name}.{hook} returned info={result.info!r}; expected a dict.")
        return replace(result, reward=self._finite_reward(result.reward, hook))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_turns={self.max_turns})"


def safe_reset(env: Environment, record: dict[str, Any], seed: int = 0) -> Observation:
    """``env.reset(record, seed)``, with any exception of the environment wrapped in :class:`EnvStepError`.

    ``KeyboardInterrupt`` and other non-``Exception`` errors pass through unchanged.
    """
    try:
        return env.reset(record, seed)
    except Exception as error:
        raise EnvStepError.wrap(env, "reset", error, record) from error


def safe_step(env: Environment, assistant_text: str) -> StepResult:
    """``env.step(assistant_text)``, with any exception of the environment wrapped in :class:`EnvStepError`.

    Misuse by the caller (a step before ``reset`` or after ``done``, a non-``str`` text) raises
    :class:`EpisodeStateError` / ``TypeError`` unwrapped: that is a coordinator bug, not an
    environment crash. ``KeyboardInterrupt`` passes through.
    """
    env._check_can_step(assistant_text)
    try:
        return env.step(assistant_text)
    except Exception as error:
        raise EnvStepError.wrap(env, "step", error, env.record) from error


@dataclass
class Episode:
    """A finished text-level episode (from :func:`run_episode`): the observations and what the model said."""

    record: dict[str, Any]
    initial_observation: Observation
    assistant_texts: list[str] = field(default_factory=list)
    results: list[StepResult] = field(default_factory=list)

    @property
    def total_reward(self) -> float:
        return sum(result.reward for result in self.results)

    @property
    def truncated(self) -> bool:
        return bool(self.results) and bool(self.results[-1].info.get("truncated"))


def run_episode(
    env: Environment,
    record: dict[str, Any],
    policy: Callable[[Observation], str],
    seed: int = 0,
) -> Episode:
    """Play one episode at the text level: ``policy(latest observation) -> assistant text``, until done.

    The reference turn loop (a token-level coordinator does the same with token ids); use it for
    scripted baselines, API-model evaluation and tests. The policy sees the initial observation,
    then each step's observation; a stateful policy (a class with ``__call__``) keeps its own
    history. Environment crashes raise :class:`EnvStepError`. The loop ends because ``step``
    enforces ``max_turns``.
    """
    observation = safe_reset(env, record, seed)
    episode = Episode(record=dict(record), initial_observation=observation)
    while not env.done:
        text = policy(observation)
        result = safe_step(env, text)
        episode.assistant_texts.append(text)
        episode.results.append(result)
        observation = result.observation if result.observation is not None else ""
    return episode
