"""Records that cross the driver/worker boundary (standard library only).

Contract: a :class:`RolloutRequest` goes from the driver to a worker; the worker answers with a
:class:`GenerationResult`: one group (a list of :class:`Rollout`) per prompt record, every sample
already scored, and the call's timings and timeline spans. Everything here
pickles (Ray ships it between processes) and imports without torch, so the driver-side controller
and the environment coordinator can use it. The torch batches the driver collates the groups into
live in :mod:`unirl_lightning.rollout.batches`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from unirl_lightning.core.checks import require_at_least, require_in_range
from unirl_lightning.core.seeding import derive_seed

FinishReason = Literal["stop", "length", "aborted"]
PolicyFamily = Literal["token", "diffusion"]
"""Which policies an engine serves: causal LMs (``"token"``) or flow-matching image models."""


def common_group_size(groups: list[list[Any]]) -> int:
    """The size every group shares (group advantages need one), or a ValueError naming the sizes."""
    if not groups:
        raise ValueError("cannot collate an empty list of groups")
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(
            f"every group must have the same size to compute group advantages, got sizes {sorted(sizes)}"
        )
    return len(groups[0])


@dataclass(frozen=True)
class SamplingParams:
    """How an engine samples completions.

    Args:
        temperature: 0 = greedy. Also the temperature of the behaviour log-probs, so the trainer
            recomputes log-probs at it (the modules take it from here).
        top_p: nucleus sampling, in ``(0, 1]``; 1 = off.
        top_k: sample among the ``top_k`` most likely tokens; 0 = off.
        min_p: drop tokens whose probability is below ``min_p`` times the top token's, in
            ``[0, 1]``; 0 = off.
        repetition_penalty: CTRL's penalty on tokens already in the prompt or completion
            (``> 0``; 1 = off, > 1 discourages repeats).
        max_new_tokens: the completion's token budget.
        stop: strings that end a completion (the stop string is kept in the text).

    Which options change the distribution sampled from: ``top_k``, ``min_p`` and ``top_p``
    truncate it (and renormalise), ``repetition_penalty`` reshapes it; ``temperature`` scales it.
    The behaviour log-prob of a sampled token is defined as its log-prob under
    ``softmax(logits / temperature)`` of the raw logits, before any truncation or penalty (TRL's
    definition; vLLM's default ``logprobs_mode="raw_logprobs"`` is the same at temperature 1), and
    the trainer recomputes exactly that, so with a truncating or reshaping option the sample comes
    from the processed distribution while both sides score it under the unprocessed one. The HF
    and SGLang engines report that value; the vLLM engine asks for
    ``logprobs_mode="processed_logprobs"`` (after temperature and every processor), which equals
    it when no truncating or reshaping option is on and otherwise is the processed value (it warns
    once). Greedy requests report log-probs at temperature 1.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop: tuple[str, ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        require_at_least("temperature", self.temperature, 0)
        require_in_range("top_p", self.top_p, 0, 1, low_open=True)
        require_at_least("max_new_tokens", self.max_new_tokens, 1)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        require_at_least("top_k", self.top_k, 0)
        require_in_range("min_p", self.min_p, 0, 1)
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0 = off), got {self.repetition_penalty!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {list(stop)!r}")
        object.__setattr__(self, "stop", stop)

    @property
    def reshapes(self) -> list[str]:
        """The options set here that truncate or reshape the sampled distribution (named as keys)."""
        if self.temperature == 0:
            return []
        names = [("top_p", self.top_p < 1), ("top_k", self.top_k > 0), ("min_p", self.min_p > 0)]
        names.append(("repetition_penalty", self.repetition_penalty != 1))
        return [name for name, on in names if on]


@dataclass
class PartialRow:
    """One sample generated in chunks (``sync_mode="interrupt"``): what it has so far.

    ``sample`` is its index among the ``n`` samples of its prompt record; ``completion_ids``,
    ``logprobs`` (the behaviour log-prob of each token) and ``token_versions`` (the weight version
    that generated each token) are aligned one entry per token. An empty row is a fresh sample.
    """

    sample: int
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not len(self.completion_ids) == len(self.logprobs) == len(self.token_versions):
            raise ValueError(
                f"a PartialRow needs one log-prob and one version per token: {len(self.completion_ids)} "
                f"tokens, {len(self.logprobs)} log-probs, {len(self.token_versions)} versions"
            )


@dataclass
class RolloutRequest:
    """One launch: ``n`` samples for each prompt record (one group per record).

    ``seed`` (None = unseeded) is the root of every seed the launch uses (see :func:`derive_seed`):
    the training loop's request ``gen_id`` of rank ``r`` has ``derive_seed(seed, r, gen_id)``.

    A *chunk* of an interruptible generation (``chunk_tokens`` set) generates only the rows in
    ``partial`` (one list per record, aligned with ``records``), each continued from prompt + its
    partial completion ``chunk_tokens`` new tokens at a time; the worker answers one group per
    record with one rollout per row, in row order, a row that is not finished yet with
    ``finish_reason="aborted"`` (see :func:`unirl_lightning.engines.base.generate_chunks`)."""

    records: list[dict[str, Any]]
    n: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    gen_id: int = -1
    chunk_tokens: int | None = None
    partial: list[list[PartialRow]] | None = None
    # chunk requests: the worker goes on chunk after chunk until every row finished or the signal
    # (``fired(epoch)``, e.g. :class:`~unirl_lightning.workers.signal.InterruptSignal`) says a sync
    # interrupts the requests launched at ``interrupt_epoch``; None = one chunk per call
    interrupt_signal: Any = None
    interrupt_epoch: int = 0

    def __post_init__(self) -> None:
        require_at_least("n", self.n, 1)
        if self.chunk_tokens is not None:
            require_at_least("chunk_tokens", self.chunk_tokens, 1)
        if self.partial is not None and len(self.partial) != len(self.records):
            raise ValueError(
                f"a chunk request needs one row list per record: {len(self.records)} records, "
                f"{len(self.partial)} row lists"
            )

    def split(self, parts: int) -> list[RolloutRequest]:
        """Split the records into at most ``parts`` contiguous, non-empty requests (groups never
        straddle); part ``p`` is seeded with ``derive_seed(seed, p)`` (None stays None)."""
        size = -(-len(self.records) // max(1, parts))
        return [
            replace(
                self,
                records=self.records[start : start + size],
                partial=None if self.partial is None else self.partial[start : start + size],
                seed=None if self.seed is None else derive_seed(self.seed, part),
            )
            for part, start in enumerate(range(0, len(self.records), size))
        ]


@dataclass
class Rollout:
    """One sampled completion with what the trainer needs to learn from it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of every completion token, at the sampling temperature
    reward: float
    finish_reason: FinishReason  # "stop" (eos, end of turn or a stop string) | "length"
    text: str = ""
    prompt: str = ""
    group_id: int = 0  # index of the prompt record in the request the engine served
    gen_id: int = -1
    weight_version: int = -1
    # 1 = a model token (trained), 0 = a tool/environment token (context only); None = all trained
    loss_mask: list[int] | None = None
    # each reward function's own score (unweighted; a "no opinion" None is left out), by name
    reward_parts: dict[str, float] = field(default_factory=dict)
    # the weight version that generated each completion token (sync_mode="interrupt": a sample may
    # span versions); None = every token by ``weight_version``
    token_versions: list[int] | None = None

    def __post_init__(self) -> None:
        if self.token_versions is not None and len(self.token_versions) != len(self.completion_ids):
            raise ValueError(
                f"a Rollout's token_versions needs one entry per completion token: {len(self.completion_ids)} "
                f"tokens, {len(self.token_versions)} versions"
            )
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"a Rollout needs one log-prob per completion token: {len(self.completion_ids)} tokens, "
                f"{len(self.logprobs)} log-probs"
            )
        if self.loss_mask is not None and len(self.loss_mask) != len(self.completion_ids):
            raise ValueError(
                f"a Rollout's loss_mask needs one entry per completion token: {len(self.completion_ids)} "
                f"tokens, {len(self.loss_mask)} mask entries"
            )

    @property
    def reward_input(self) -> str:
        """What a reward scores: the decoded completion."""
        return self.text

    def versions(self) -> list[int]:
        """The weight version of every completion token (``token_versions``, else ``weight_version``)."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [self.weight_version] * len(self.completion_ids)

    @staticmethod
    def reward_columns(rollouts: list[Rollout]) -> dict[str, list[Any]]:
        """What a TRL-style reward function may also ask for, one entry per rollout."""
        return {
            "completion_ids": [list(r.completion_ids) for r in rollouts],
            "finish_reasons": [r.finish_reason for r in rollouts],
        }


@dataclass
class AgenticRollout(Rollout):
    """One multi-turn episode as one trained sequence (built by the agentic coordinator in a worker).

    ``prompt_ids`` is the initial observation; ``completion_ids`` every later token in order (model
    turns and the observations between them), ``loss_mask`` 1 on model tokens and 0 on observation
    tokens, ``logprobs`` the behaviour log-prob of each model token (0 on observation tokens).
    ``reward`` is the episode's return; ``text`` the decoded episode after the prompt.
    """

    sample_id: str = ""  # "root/k": the k-th sibling of the group ``root`` (one prompt record)
    num_turns: int = 0  # model turns played
    tool_calls: int = 0  # the environment's ``info["tool_calls"]`` at the last step (0 if it has none)
    turn_versions: list[int] = field(default_factory=list)  # engine weight version of each model turn
    truncated: bool = False  # ended by the turn limit
    truncated_turns: int = 0  # chat model turns the token budget cut (closed, or the episode ended there)
    context_limited: bool = False  # ended by the context budget (max_context_tokens / max_model_len)
    env_error: str | None = None  # the EnvStepError message when the environment crashed (never trained)
    reward_timeouts: int = (
        0  # answer checks the environment's reward gave up on in this episode (scored wrong)
    )
    generate_s: float = 0.0  # this episode's share of the generation calls' time


@dataclass
class GenerationResult:
    """What one generation call answers: a worker's part of a request, a whole request (its parts
    merged, in worker order) or a chunked request's chunks folded together.

    Args:
        groups: one group of samples per prompt record, in the request's order, every sample scored.
        generate_s: seconds generating (a merged call: its slowest part's).
        score_s: seconds scoring (a merged call: its slowest part's).
        span: a worker's own stamp of its part, ``{"start", "end"}`` on the worker's wall clock.
        spans: a merged call's timeline spans on the driver's clock, one per part (``worker``,
            ``start``, ``end``, ``samples``, ``completion_tokens``; a chunk adds ``chunk`` and
            ``interrupted``).
        score_span: a reward worker's stamp of its scoring (``start``, ``end``, ``reward_worker``).
        score_spans: a merged call's reward-worker stamps.
        reward_timeouts: checks the reward gave up on while scoring these groups (a merged call:
            its parts' sum).
    """

    groups: list[list[Any]]
    generate_s: float = 0.0
    score_s: float = 0.0
    span: dict[str, Any] | None = None
    spans: list[dict[str, Any]] = field(default_factory=list)
    score_span: dict[str, Any] | None = None
    score_spans: list[dict[str, Any]] = field(default_factory=list)
    reward_timeouts: int = 0


@dataclass(frozen=True)
class DiffusionSampling:
    """How the diffusion engine samples: ``num_steps`` denoising steps, the SDE on ``sde_indices``.

    Args:
        num_steps: denoising steps of the sampler (the scheduler's sigmas, ``1.0 -> 0.0``).
        eta: noise level of the Flow-GRPO SDE (its ``noise_level``), ``>= 0``. ``eta=0`` is the
            deterministic ODE (evaluation): no step is stochastic and nothing is recorded.
        sde_indices: the step indices (in ``[0, num_steps)``) that run the SDE and are recorded
            for training; ``None`` = every step when ``eta > 0``. A window such as ``[0, 1, 2]``
            trains on the early, high-noise steps only (Flow-GRPO-Fast, MixGRPO).
        guidance_scale: classifier-free guidance; 1.0 = off (one denoiser call per step).

    Example::

        DiffusionSampling(num_steps=10, eta=0.7, sde_indices=(0, 1, 2, 3))
    """

    num_steps: int = 10
    eta: float = 1.0
    sde_indices: tuple[int, ...] | None = None
    guidance_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if not self.eta >= 0:
            raise ValueError(f"eta must be >= 0 (0 = the deterministic ODE), got {self.eta!r}")
        if not self.guidance_scale >= 0:
            raise ValueError(f"guidance_scale must be >= 0 (1.0 = no guidance), got {self.guidance_scale!r}")
        if self.sde_indices is None:
            return
        indices = tuple(int(i) for i in self.sde_indices)
        outside = [i for i in indices if not 0 <= i < self.num_steps]
        if outside:
            raise ValueError(
                f"sde_indices {list(indices)} fall outside the schedule: {outside} not in "
                f"[0, num_steps={self.num_steps})"
            )
        if len(set(indices)) != len(indices):
            raise ValueError(f"sde_indices must not repeat a step, got {list(indices)}")
        if self.eta == 0 and indices:
            raise ValueError(
                f"eta=0 is the deterministic ODE, so no step can be an SDE step; got sde_indices={list(indices)} "
                "(give eta > 0, or sde_indices=None / [])"
            )
        object.__setattr__(self, "sde_indices", tuple(sorted(indices)))

    def sde_steps(self) -> tuple[int, ...]:
        """The step indices that run the SDE and are recorded (empty for ``eta=0``)."""
        if self.eta == 0:
            return ()
        return tuple(range(self.num_steps)) if self.sde_indices is None else self.sde_indices
