"""Records that cross the driver/worker boundary.

Contract: a :class:`RolloutRequest` goes from the driver to a worker; the worker answers with one
group (a list of :class:`Rollout`) per prompt record, every sample already scored. The driver
collates the groups it trains on into one :class:`ExperienceBatch` of padded tensors.

Two families share the shape: token policies (:class:`SamplingParams`, :class:`Rollout`,
:class:`ExperienceBatch`) and diffusion policies (:class:`DiffusionSampling`,
:class:`DiffusionRollout`, :class:`DiffusionBatch`). Everything here pickles (Ray ships it between
processes); the batches have ``to(device)`` and ``select(rows)`` so Lightning moves them like any
batch and the modules cut mini-batches from them. A batch's ``collate(groups)`` also computes the
rollout statistics only its family has (e.g. completion length), so the loop never inspects
record types.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import numpy as np
import torch

from unirl_lightning.checks import require_at_least, require_in_range

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


SEED_BITS = 63
"""Derived seeds lie in ``[0, 2**63)``: a non-negative int64, which every engine takes as it is
(``torch.Generator.manual_seed``, vLLM's ``SamplingParams.seed``, SGLang's ``sampling_seed``)."""


def derive_seed(*parts: int) -> int:
    """A seed that is a hash of ``parts`` (ints, any size, any sign), in ``[0, 2**SEED_BITS)``.

    Every seed of a run is derived with it, level by level: a request's from ``(seed, rank, gen_id)``,
    a worker's part of it from ``(request seed, part index)`` (:meth:`RolloutRequest.split`), and an
    engine's per-sample (or per-chunk) seeds from ``(part seed, sample or chunk index)``. Unlike sums
    such as ``seed + rank * 1_000_003 + gen_id + i``, distinct paths give unrelated seeds (two of
    ``k`` seeds coincide with probability about ``k**2 / 2**64``), and the same parts always give the
    same seed (BLAKE2b: no process-dependent hashing), so a run is reproducible.

    >>> derive_seed(0, 1) == derive_seed(0, 1) != derive_seed(1, 0)
    True
    >>> 0 <= derive_seed(-5, 2**80) < 2**63
    True
    """
    payload = ",".join(str(int(part)) for part in parts).encode()
    digest = hashlib.blake2b(payload, digest_size=8, person=b"unirl-seed").digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def global_seed(default: int = 0) -> int:
    """The seed of ``lightning.seed_everything`` (the CLI's ``seed_everything``), read where Lightning
    puts it for its own worker processes (the ``PL_GLOBAL_SEED`` environment variable), else
    ``default``. Defaults that follow it (the strategy's rollout seed, LoRA's initialisation) make
    ``--seed_everything 1`` a different run from ``--seed_everything 0``.

    >>> import os
    >>> os.environ["PL_GLOBAL_SEED"] = "7"; global_seed()
    7
    >>> del os.environ["PL_GLOBAL_SEED"]; global_seed(3)
    3
    """
    value = os.environ.get("PL_GLOBAL_SEED")
    return int(value) if value not in (None, "") else default


def derive_seeds(seed: int | None, count: int) -> list[int | None]:
    """The per-sample seeds of ``count`` samples (rows) under ``seed``: ``derive_seed(seed, k)`` for
    sample ``k``, or ``None`` for each when ``seed`` is None (unseeded). The engines that seed each
    sample (vLLM, SGLang) take their seeds from here.

    >>> derive_seeds(None, 2)
    [None, None]
    >>> derive_seeds(7, 2) == [derive_seed(7, 0), derive_seed(7, 1)]
    True
    """
    return [None] * count if seed is None else [derive_seed(seed, k) for k in range(count)]


@dataclass
class RolloutRequest:
    """One launch: ``n`` samples for each prompt record (one group per record).

    ``seed`` (None = unseeded) is the root of every seed the launch uses (see :func:`derive_seed`):
    the training loop's request ``gen_id`` of rank ``r`` has ``derive_seed(seed, r, gen_id)``."""

    records: list[dict[str, Any]]
    n: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    gen_id: int = -1

    def __post_init__(self) -> None:
        require_at_least("n", self.n, 1)

    def split(self, parts: int) -> list[RolloutRequest]:
        """Split the records into at most ``parts`` contiguous, non-empty requests (groups never
        straddle); part ``p`` is seeded with ``derive_seed(seed, p)`` (None stays None)."""
        size = -(-len(self.records) // max(1, parts))
        return [
            replace(
                self,
                records=self.records[start : start + size],
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

    def __post_init__(self) -> None:
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
    generate_s: float = 0.0  # this episode's share of the generation calls' time


@dataclass
class ExperienceBatch:
    """Padded tensors for one training step, ``num_groups * group_size`` rows, prompt + completion.

    Row ``i`` holds ``prompt_ids + completion_ids`` right-padded to the longest row. ``response_mask``
    marks the completion tokens a loss is taken over (all of them, or those with ``loss_mask`` 1:
    a multi-turn episode's model tokens, not its tool/environment tokens); ``rollout_logprobs`` is
    aligned with ``input_ids`` (zero outside the completion). Rows are ordered group by group.
    """

    input_ids: torch.Tensor  # [N, L] long
    attention_mask: torch.Tensor  # [N, L] long
    response_mask: torch.Tensor  # [N, L] float, 1 on completion tokens
    rollout_logprobs: torch.Tensor  # [N, L] float
    rewards: torch.Tensor  # [N]
    weight_versions: torch.Tensor  # [N] long, launch-time stamp of each row
    gen_ids: torch.Tensor  # [N] long
    group_size: int
    advantages: torch.Tensor | None = None  # [N], filled by the module
    stats: dict[str, float] = field(default_factory=dict)  # rollout-side metrics for this step

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> ExperienceBatch:
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def select(self, rows: torch.Tensor | slice) -> ExperienceBatch:
        """The same batch restricted to ``rows`` (for mini-batches)."""
        picked = {
            f.name: getattr(self, f.name)[rows]
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **picked)

    @classmethod
    def collate(cls, groups: list[list[Rollout]], pad_token_id: int) -> ExperienceBatch:
        """Collate scored groups (all of one size) into padded tensors; ``stats`` gets the
        completion-length figures (mean, max, fraction truncated at the token budget)."""
        group_size = common_group_size(groups)
        rows = [r for g in groups for r in g]
        length = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
        num = len(rows)
        # padded Python lists, one tensor per field (a few small tensor ops per row cost more)
        ids, attention, response, logprobs = [], [], [], []
        for r in rows:
            p, c = len(r.prompt_ids), len(r.completion_ids)
            pad = length - p - c
            ids.append(r.prompt_ids + r.completion_ids + [pad_token_id] * pad)
            attention.append([1] * (p + c) + [0] * pad)
            response.append(
                [0.0] * p
                + ([1.0] * c if r.loss_mask is None else [float(m) for m in r.loss_mask])
                + [0.0] * pad
            )
            logprobs.append([0.0] * p + list(r.logprobs) + [0.0] * pad)
        input_ids = torch.tensor(ids, dtype=torch.long)
        attention_mask = torch.tensor(attention, dtype=torch.long)
        response_mask = torch.tensor(response, dtype=torch.float32)
        rollout_logprobs = torch.tensor(logprobs, dtype=torch.float32)
        lengths = [len(r.completion_ids) for r in rows]
        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            response_mask=response_mask,
            rollout_logprobs=rollout_logprobs,
            rewards=torch.tensor([r.reward for r in rows], dtype=torch.float32),
            weight_versions=torch.tensor([r.weight_version for r in rows], dtype=torch.long),
            gen_ids=torch.tensor([r.gen_id for r in rows], dtype=torch.long),
            group_size=group_size,
            stats={
                "rollout/completion_len": sum(lengths) / num,
                "rollout/completion_tokens": float(sum(lengths)),
                "rollout/completion_len_max": float(max(lengths)),
                "rollout/truncated_fraction": sum(r.finish_reason == "length" for r in rows) / num,
            },
        )


# -- diffusion policies ---------------------------------------------------------------------------
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


@dataclass
class DiffusionRollout:
    """One sampled image with the SDE trajectory the trainer replays (``S`` recorded steps).

    ``latents[s]`` is the input of recorded step ``s`` and ``next_latents[s]`` its sampled output;
    ``log_probs[s]`` is the Gaussian log-prob of that transition (mean over latent elements).
    """

    image: np.ndarray  # uint8 [H, W, 3]
    latents: torch.Tensor  # [S, C, h, w] float32
    next_latents: torch.Tensor  # [S, C, h, w] float32
    log_probs: torch.Tensor  # [S] float32
    sigmas: torch.Tensor  # [S] float32, sigma of each recorded step
    sigmas_next: torch.Tensor  # [S] float32
    eta: float
    guidance_scale: float = 1.0
    record: dict[str, Any] = field(default_factory=dict)
    reward: float = 0.0
    prompt: str = ""
    group_id: int = 0
    gen_id: int = -1
    weight_version: int = -1
    reward_parts: dict[str, float] = field(default_factory=dict)  # each reward function's own score

    @staticmethod
    def reward_columns(rollouts: list[DiffusionRollout]) -> dict[str, list[Any]]:
        """An image has no token ids or finish reason for a reward function to ask for."""
        return {}

    def __post_init__(self) -> None:
        steps = self.log_probs.shape[0]
        if self.latents.shape != self.next_latents.shape or self.latents.shape[:1] != (steps,):
            raise ValueError(
                f"a DiffusionRollout needs latents and next_latents of shape [S, ...] with S = {steps} "
                f"log-probs, got {tuple(self.latents.shape)} and {tuple(self.next_latents.shape)}"
            )
        if self.sigmas.shape != (steps,) or self.sigmas_next.shape != (steps,):
            raise ValueError(
                f"a DiffusionRollout needs one sigma per recorded step ({steps}), got "
                f"{tuple(self.sigmas.shape)} and {tuple(self.sigmas_next.shape)}"
            )

    @property
    def reward_input(self) -> np.ndarray:
        """What an image reward scores: the ``uint8`` image ``[H, W, 3]``."""
        return self.image


@dataclass
class DiffusionBatch:
    """The recorded SDE steps of ``num_groups * group_size`` images, rows ordered group by group.

    ``latents[i, s]`` / ``next_latents[i, s]`` are the input and sampled output of recorded step ``s``
    of row ``i``, ``log_probs[i, s]`` its behaviour log-prob, ``sigmas[i, s]`` / ``sigmas_next[i, s]``
    its noise levels. ``records`` are the prompt records (the trainer re-encodes the conditioning).
    """

    latents: torch.Tensor  # [N, S, C, h, w] float32
    next_latents: torch.Tensor  # [N, S, C, h, w] float32
    log_probs: torch.Tensor  # [N, S] float32
    sigmas: torch.Tensor  # [N, S]
    sigmas_next: torch.Tensor  # [N, S]
    images: torch.Tensor  # [N, H, W, 3] uint8
    rewards: torch.Tensor  # [N]
    weight_versions: torch.Tensor  # [N] long, launch-time stamp of each row
    gen_ids: torch.Tensor  # [N] long
    group_size: int
    records: list[dict[str, Any]]
    eta: float
    guidance_scale: float = 1.0
    advantages: torch.Tensor | None = None  # [N], filled by the module
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return int(self.rewards.shape[0])

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }

    def to(self, device: torch.device | str) -> DiffusionBatch:
        return replace(self, **{name: t.to(device) for name, t in self._tensors().items()})

    def select(self, rows: torch.Tensor) -> DiffusionBatch:
        """The same batch restricted to ``rows`` (an index tensor, for mini-batches)."""
        picked = {name: t[rows.to(t.device)] for name, t in self._tensors().items()}
        return replace(self, **picked, records=[self.records[i] for i in rows.tolist()])

    @classmethod
    def collate(cls, groups: list[list[DiffusionRollout]]) -> DiffusionBatch:
        """Stack scored groups (all of one size, all with the same recorded steps) into one batch."""
        group_size = common_group_size(groups)
        rows = [r for g in groups for r in g]
        steps = {tuple(r.latents.shape) for r in rows}
        if len(steps) != 1:
            raise ValueError(
                f"every rollout of a batch must record the same SDE steps, got latent shapes {sorted(steps)}"
            )
        etas = {(r.eta, r.guidance_scale) for r in rows}
        if len(etas) != 1:
            raise ValueError(
                f"every rollout of a batch must share eta and guidance_scale, got {sorted(etas)}"
            )
        eta, guidance_scale = etas.pop()
        return cls(
            latents=torch.stack([r.latents for r in rows]),
            next_latents=torch.stack([r.next_latents for r in rows]),
            log_probs=torch.stack([r.log_probs for r in rows]),
            sigmas=torch.stack([r.sigmas for r in rows]),
            sigmas_next=torch.stack([r.sigmas_next for r in rows]),
            images=torch.from_numpy(np.stack([r.image for r in rows])),
            rewards=torch.tensor([r.reward for r in rows], dtype=torch.float32),
            weight_versions=torch.tensor([r.weight_version for r in rows], dtype=torch.long),
            gen_ids=torch.tensor([r.gen_id for r in rows], dtype=torch.long),
            group_size=group_size,
            records=[r.record for r in rows],
            eta=eta,
            guidance_scale=guidance_scale,
        )
