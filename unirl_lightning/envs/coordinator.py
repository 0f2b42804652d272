"""The agentic coordinator: drives multi-turn episodes inside a rollout worker, many per generation call.

Who calls it
    A :class:`~unirl_lightning.workers.agentic_actor.AgenticRolloutWorker` holds one and exposes its four verbs as
    actor methods; the driver reaches them through
    :class:`~unirl_lightning.workers.agentic.WorkerEpisodeCoordinator`, which the
    :class:`~unirl_lightning.agentic.controller.AgenticRolloutController` drives. This class implements
    the coordinator contract of :mod:`unirl_lightning.agentic.controller` (read it first):
    ``submit`` / ``poll`` / ``finalize_if_drained`` / ``abort``, plus ``suspended()``.

How a drive runs (one background thread, started by ``submit``)
    Every episode gets its own environment (``EnvSpec.build()``) and :func:`safe_reset`; its
    initial observation is tokenized once into ``prompt_ids``. Then, turn by turn, the whole
    context of *every* live episode goes to one ``engine.generate_ids(contexts, sampling, seed)``
    call; each episode appends its completion tokens (``loss_mask`` 1, their behaviour log-probs),
    decodes them, and calls :func:`safe_step` with the text; an episode that goes on appends the
    tokens of the observation (``loss_mask`` 0, log-prob 0). Earlier turns are never
    re-tokenized: the ids the engine sampled are the ids the trainer scores. An episode that ends
    becomes an :class:`~unirl_lightning.rollout.records.AgenticRollout` at once (``poll`` returns it),
    with the episode's return as its reward.

Sampling seeds
    Model turn ``t`` of the episode seeded ``s`` is sampled with :func:`~unirl_lightning.core.seeding.turn_seed`
    ``(s, t)``, and a generation call with :func:`~unirl_lightning.core.seeding.call_seed` of its rows' turn
    seeds: they depend only on which episode turns share the call, never on the drive that plays them.

Truncated turns and the context budget (:class:`~unirl_lightning.envs.episode.EpisodeSettings`)
    A chat model turn cut at ``max_new_tokens`` has no end-of-turn token. The environment still steps
    on its text; then ``truncated_turn="close"`` appends the chat template's end of an assistant
    message (``loss_mask`` 0, log-prob 0) before the next observation, and ``"end"`` ends the episode
    with the return paid so far. Either way the sample's ``truncated_turns`` counts it (raw-string
    episodes have no end-of-turn token: nothing is appended or counted). An episode whose next turn
    would exceed ``max_context_tokens`` or the engine's ``max_model_len`` ends cleanly before it
    (``context_limited``), so no generation call overflows the engine.

Turn boundaries, abort and carried episodes
    ``abort()`` sets a flag the drive checks before each generation call, waits for the turn in
    progress to finish (its finished episodes are what ``abort`` returns), and *suspends* the
    episodes still live: their tokens, masks, log-probs and environments stay in the worker, and
    ``suspended()`` lists their sample ids. The next ``submit`` resumes every suspended episode it
    names by sample id (the carry tail policy: the episode continues under the weights loaded since,
    each turn's version is in ``turn_versions``) and discards the others (the drop tail policy). A
    turn is never split across weight versions: weights are loaded only between drives.

Environment errors
    ``on_env_error="raise"``: the drive stops at the crash (the other episodes are abandoned), every
    later ``poll`` raises the :class:`~unirl_lightning.envs.base.EnvStepError` (it names the
    environment, the phase, the turn and the record) and ``finalize_if_drained`` answers False, until
    an ``abort`` raises it one last time and ends the drive.
    ``on_env_error="drop"``: that episode ends as a sample with ``env_error`` set (reward 0), so its
    group still completes and the driver counts it and never trains on it; the drive goes on. Any
    other exception inside the drive (the engine's) is raised like ``"raise"``.

Requirements on the engine
    ``generate_ids(prompt_ids: list[list[int]], sampling, seed) -> [(completion_ids, logprobs,
    finish_reason)]``, a ``tokenizer`` (HF: ``__call__``, ``decode``, ``apply_chat_template`` for chat
    observations) and ``weight_version``; optionally ``max_model_len`` (an int: the longest context
    it serves). The HF and vLLM engines have them; others raise ``NotImplementedError`` naming the
    engine when a coordinator is built on them.

This module imports no torch: the standard library, :mod:`unirl_lightning.envs`, records, seeds,
:func:`~unirl_lightning.rewards.scoring.reward_timeouts`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from unirl_lightning.core.seeding import call_seed, turn_seed
from unirl_lightning.envs.base import Environment, EnvStepError, safe_reset, safe_step
from unirl_lightning.envs.episode import (
    EpisodeRequest,
    EpisodeSettings,
    OnEnvError,
    TruncatedTurn,
    context_limit,
    observation_ids,
    prompt_ids_of,
    turn_closing_ids,
)
from unirl_lightning.envs.spec import EnvSpec
from unirl_lightning.rewards.scoring import reward_timeouts
from unirl_lightning.rollout.records import AgenticRollout

__all__ = ["EpisodeCoordinator", "EpisodeRequest", "EpisodeSettings", "OnEnvError", "TruncatedTurn"]
__all__ += ["call_seed", "observation_ids", "prompt_ids_of", "turn_closing_ids", "turn_seed"]

log = logging.getLogger(__name__)


@dataclass
class _Episode:
    """A live episode's state in the worker: its environment and every token so far."""

    request: EpisodeRequest
    env: Environment | None = None
    chat_role: str | None = None  # the observation role when the episode is a chat, else None
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # every token after the prompt
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    tool_calls: int = 0
    truncated: bool = False  # ended by the environment's turn limit
    cut: bool = False  # ended by a truncated turn (truncated_turn="end") or the context budget
    truncated_turns: int = 0  # chat model turns the token budget cut (no end-of-turn token sampled)
    context_limited: bool = False
    model_end: int = 0  # len(ids) after the last model turn (and its closing): where a cut episode ends
    generate_s: float = 0.0
    error: str | None = None
    reward_timeouts: int = 0  # the environment's answer checks that ran out (in its steps)


class EpisodeCoordinator:
    """Plays episodes of one environment with one engine, in a background thread of the worker.

    Args:
        engine: has ``generate_ids``, ``tokenizer`` and ``weight_version`` (see the module docstring).
        env: the environment spec; one environment is built per episode.
        sampling: the per-turn sampling (``max_new_tokens`` is per model turn).
        settings: an :class:`~unirl_lightning.envs.episode.EpisodeSettings`, or just its ``on_env_error``: ``"raise"`` (stop the
            drive, re-raise on the driver) or ``"drop"`` (fail that episode, count it, go on).

    Example::

        coordinator = EpisodeCoordinator(engine, resolve_environment("unirl_lightning.envs:GuessingGameEnv"),
                                         SamplingParams(max_new_tokens=1))
        coordinator.submit([EpisodeRequest("g0/0", record), EpisodeRequest("g0/1", record, seed=1)])
        while not coordinator.finalize_if_drained():
            samples = coordinator.poll()
    """

    def __init__(
        self, engine: Any, env: EnvSpec, sampling: Any, settings: EpisodeSettings | OnEnvError = "raise"
    ) -> None:
        if not callable(getattr(engine, "generate_ids", None)):
            raise NotImplementedError(
                f"agentic rollouts need the engine's token-level generate_ids(prompt_ids, sampling, seed); "
                f"{type(engine).__name__} does not implement it yet: serve agentic modules with engine='hf', 'vllm' or 'sglang'"
            )
        if not isinstance(settings, EpisodeSettings):
            settings = EpisodeSettings(on_env_error=settings)
        self._sample_cls = AgenticRollout
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.env = env
        self.sampling = sampling
        self.settings = settings
        self.on_env_error: OnEnvError = settings.on_env_error
        self.context_limit = context_limit(
            settings.max_context_tokens, getattr(engine, "max_model_len", None)
        )
        self._closing_ids: list[int] | None = None  # the chat template's end of turn, read when first needed
        self._lock = threading.Lock()
        self._abort = threading.Event()
        self._thread: threading.Thread | None = None
        self._running = False
        self._completed: list[Any] = []
        self._error: BaseException | None = None
        self._suspended: dict[str, _Episode] = {}
        self.generation_calls = 0  # for tests and logs: one per turn of a drive (per max_batch_size rows)
        self.discarded = 0  # suspended episodes a later submit did not resume
        self.truncated_turns = 0  # chat model turns the token budget cut (closed or ended)
        self.context_limited = 0  # episodes the context budget ended

    # -- the coordinator contract -----------------------------------------------------------------
    @property
    def drive_live(self) -> bool:
        """True from ``submit`` until ``finalize_if_drained()`` returns True or ``abort()`` returns."""
        return self._thread is not None

    def submit(self, requests: list[EpisodeRequest]) -> None:
        """Start a drive over ``requests`` (resuming the suspended episodes they name, discarding the
        other suspended ones) and return at once. Raises ``RuntimeError`` while a drive is live."""
        if self._thread is not None:
            raise RuntimeError(
                "submit refused: a drive is live in this worker; poll until finalize_if_drained() is True, "
                "or abort(), first"
            )
        ids = [request.sample_id for request in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"submit got a sample_id twice: {sorted(i for i in ids if ids.count(i) > 1)}")
        resumed = [self._suspended.pop(r.sample_id) for r in requests if r.sample_id in self._suspended]
        self.discarded += len(self._suspended)
        self._suspended.clear()
        resumed_ids = {episode.request.sample_id for episode in resumed}
        fresh = [_Episode(request) for request in requests if request.sample_id not in resumed_ids]
        self._abort.clear()
        self._error = None
        self._running = True
        self._thread = threading.Thread(
            target=self._drive, args=(fresh, resumed), name="agentic-drive", daemon=True
        )
        self._thread.start()

    def poll(self) -> list[Any]:
        """Every episode finished since the last ``poll``/``abort``, once; raises a drive's error."""
        with self._lock:
            if self._error is not None:
                raise self._error
            completed, self._completed = self._completed, []
        return completed

    def finalize_if_drained(self) -> bool:
        """If the drive ended and every sample it made was polled: join it, return True (also when no
        drive is live); otherwise change nothing and return False."""
        with self._lock:
            if self._thread is None:
                return True
            if self._running or self._completed or self._error is not None:
                return False
            thread, self._thread = self._thread, None
        thread.join()
        return True

    def abort(self) -> list[Any]:
        """Stop the drive at the next turn boundary; returns the episodes that finished meanwhile.

        Episodes finished before the call and not yet polled stay for one more ``poll``; the live
        ones are suspended (``suspended()``). Raises the drive's error, if it had one.
        """
        with self._lock:
            thread = self._thread
            before = len(self._completed)
            self._abort.set()
        if thread is None:
            return []
        thread.join()
        with self._lock:
            finished = self._completed[before:]
            del self._completed[before:]
            self._thread = None
            error, self._error = self._error, None
        if error is not None:
            raise error
        return finished

    def suspended(self) -> list[str]:
        """Sample ids of the episodes the last ``abort`` stopped, which a later ``submit`` may resume."""
        with self._lock:
            return list(self._suspended)

    def close(self) -> None:
        """Stop any drive (the worker is going away)."""
        self._abort.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- the drive --------------------------------------------------------------------------------
    def _drive(self, fresh: list[_Episode], resumed: list[_Episode]) -> None:
        live: list[_Episode] = list(resumed)
        try:
            for episode in fresh:
                if self._start(episode):
                    live.append(episode)
            while live and not self._abort.is_set():  # the turn boundary: abort is honoured only here
                live = self._turn(live)
        except BaseException as error:  # noqa: BLE001 - surfaced by the next poll / abort
            log.warning("agentic drive stopped: %s: %s", type(error).__name__, error)
            with self._lock:
                self._error = error
            live = []
        finally:
            with self._lock:
                if self._abort.is_set():
                    self._suspended = {episode.request.sample_id: episode for episode in live}
                self._running = False

    def _start(self, episode: _Episode) -> bool:
        """Build and reset the episode's environment; False if it failed (``on_env_error="drop"``)."""
        request = episode.request
        episode.env = self.env.build()
        try:
            observation = safe_reset(episode.env, request.record, request.seed)
        except EnvStepError as error:
            self._fail(episode, error)
            return False
        if not isinstance(observation, str):
            episode.chat_role = type(episode.env).observation_role
        episode.prompt_ids = prompt_ids_of(self.tokenizer, observation)
        return True

    def _turn(self, live: list[_Episode]) -> list[_Episode]:
        """One model turn of every live episode (one generation call), then one environment step each.

        First, episodes whose context would outgrow the budget in this turn end (the context budget).
        """
        live = [episode for episode in live if self._fits(episode)]
        if not live:
            return []
        seeds = [turn_seed(e.request.seed, len(e.turn_versions)) for e in live]
        start = time.perf_counter()
        outputs = self.engine.generate_ids(
            [e.prompt_ids + e.ids for e in live], self.sampling, call_seed(seeds)
        )
        share = (time.perf_counter() - start) / len(live)
        self.generation_calls += 1
        version = self.engine.weight_version
        still_live = []
        for episode, (completion, logprobs, finish) in zip(live, outputs):
            episode.ids += completion
            episode.mask += [1] * len(completion)
            episode.logprobs += logprobs
            episode.turn_versions.append(version)
            episode.generate_s += share
            cut_turn = finish == "length" and episode.chat_role is not None  # no end-of-turn token sampled
            if cut_turn:
                episode.truncated_turns += 1
                self.truncated_turns += 1
            episode.model_end = len(episode.ids)
            text = self.tokenizer.decode(completion, skip_special_tokens=True)
            checks = getattr(episode.env, "reward", None)  # an answer-checking environment's reward
            before = reward_timeouts(checks)
            try:
                result = safe_step(episode.env, text)
            except EnvStepError as error:
                self._fail(episode, error)
                continue
            finally:
                episode.reward_timeouts += reward_timeouts(checks) - before
            episode.reward += result.reward
            episode.tool_calls = int(result.info.get("tool_calls", episode.tool_calls))
            if result.done:
                episode.truncated = bool(result.info.get("truncated", False))
                self._emit(episode)
                continue
            if cut_turn and self.settings.truncated_turn == "end":  # the return so far, this step's included
                episode.cut = True
                self._emit(episode)
                continue
            if cut_turn:  # "close": the template's end of turn, which the model did not sample
                self._append_context(episode, self._closing())
                episode.model_end = len(episode.ids)
            self._append_context(
                episode, observation_ids(self.tokenizer, result.observation, episode.chat_role)
            )
            still_live.append(episode)
        return still_live

    def _fits(self, episode: _Episode) -> bool:
        """True if the episode's next turn fits the context budget; otherwise end it (its return so
        far, the observation after its last model turn cut off) and return False."""
        limit = self.context_limit
        if (
            limit is None
            or len(episode.prompt_ids) + len(episode.ids) + self.sampling.max_new_tokens <= limit
        ):
            return True
        end = episode.model_end
        del episode.ids[end:], episode.mask[end:], episode.logprobs[end:]
        episode.cut = episode.context_limited = True
        self.context_limited += 1
        self._emit(episode)
        return False

    def _closing(self) -> list[int]:
        if self._closing_ids is None:
            self._closing_ids = turn_closing_ids(self.tokenizer)
        return self._closing_ids

    @staticmethod
    def _append_context(episode: _Episode, ids: list[int]) -> None:
        """Tokens the model did not sample (observations, a closing end of turn): loss_mask 0, log-prob 0."""
        episode.ids += ids
        episode.mask += [0] * len(ids)
        episode.logprobs += [0.0] * len(ids)

    def _fail(self, episode: _Episode, error: EnvStepError) -> None:
        if self.on_env_error == "raise":
            raise error
        log.warning("episode %s failed and is dropped: %s", episode.request.sample_id, error)
        episode.error = str(error)
        episode.reward = 0.0
        self._emit(episode)

    def _emit(self, episode: _Episode) -> None:
        request = episode.request
        sample = self._sample_cls(
            prompt_ids=episode.prompt_ids,
            completion_ids=episode.ids,
            logprobs=episode.logprobs,
            reward=episode.reward,
            finish_reason="length" if episode.truncated or episode.cut else "stop",
            text=self.tokenizer.decode(episode.ids, skip_special_tokens=True),
            prompt=str(request.record.get("prompt", "")),
            loss_mask=episode.mask,
            sample_id=request.sample_id,
            num_turns=len(episode.turn_versions),
            tool_calls=episode.tool_calls,
            turn_versions=episode.turn_versions,
            truncated=episode.truncated,
            truncated_turns=episode.truncated_turns,
            context_limited=episode.context_limited,
            env_error=episode.error,
            reward_timeouts=episode.reward_timeouts,
            generate_s=episode.generate_s,
        )
        with self._lock:
            self._completed.append(sample)
