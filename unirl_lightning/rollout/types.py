"""Records that cross the driver/worker boundary.

Contract: a :class:`RolloutRequest` goes from the driver to a worker; the worker answers with one
group (a list of :class:`Rollout`) per prompt record, every sample already scored. The driver
collates the groups it trains on into one :class:`ExperienceBatch` of padded tensors.

Everything here pickles (Ray ships it between processes); ``ExperienceBatch`` is the only record
that holds tensors, and it has a ``to(device)`` so Lightning moves it like any batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch


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

    ``temperature`` is also the temperature at which behaviour log-probs are computed, so the
    trainer must recompute log-probs at the same temperature (the modules take it from here).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class RolloutRequest:
    """One launch: ``n`` samples for each prompt record (one group per record)."""

    records: list[dict[str, Any]]
    n: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    gen_id: int = -1

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {self.n}")

    def split(self, parts: int) -> list[RolloutRequest]:
        """Split the records into at most ``parts`` contiguous, non-empty requests (groups never straddle)."""
        size = -(-len(self.records) // max(1, parts))
        return [
            replace(
                self, records=self.records[i : i + size], seed=None if self.seed is None else self.seed + i
            )
            for i in range(0, len(self.records), size)
        ]


@dataclass
class Rollout:
    """One sampled completion with what the trainer needs to learn from it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of every completion token, at the sampling temperature
    reward: float
    finish_reason: str  # "stop" (eos or a stop string) | "length"
    text: str = ""
    prompt: str = ""
    group_id: int = 0
    gen_id: int = -1
    weight_version: int = -1

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"a Rollout needs one log-prob per completion token: {len(self.completion_ids)} tokens, "
                f"{len(self.logprobs)} log-probs"
            )


@dataclass
class ExperienceBatch:
    """Padded tensors for one training step, ``num_groups * group_size`` rows, prompt + completion.

    Row ``i`` holds ``prompt_ids + completion_ids`` right-padded to the longest row. ``response_mask``
    marks completion tokens (the positions a loss is taken over); ``rollout_logprobs`` is aligned
    with ``input_ids`` (zero outside the completion). Rows are ordered group by group.
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
    def collate(cls, groups: list[list[Rollout]], pad_token_id: int, stats: dict[str, float] | None = None):
        """Collate scored groups (all of one size) into padded tensors."""
        group_size = common_group_size(groups)
        rows = [r for g in groups for r in g]
        length = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
        num = len(rows)
        input_ids = torch.full((num, length), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((num, length), dtype=torch.long)
        response_mask = torch.zeros((num, length), dtype=torch.float32)
        rollout_logprobs = torch.zeros((num, length), dtype=torch.float32)
        for i, r in enumerate(rows):
            p, c = len(r.prompt_ids), len(r.completion_ids)
            input_ids[i, : p + c] = torch.tensor(r.prompt_ids + r.completion_ids, dtype=torch.long)
            attention_mask[i, : p + c] = 1
            response_mask[i, p : p + c] = 1.0
            rollout_logprobs[i, p : p + c] = torch.tensor(r.logprobs, dtype=torch.float32)
        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            response_mask=response_mask,
            rollout_logprobs=rollout_logprobs,
            rewards=torch.tensor([r.reward for r in rows], dtype=torch.float32),
            weight_versions=torch.tensor([r.weight_version for r in rows], dtype=torch.long),
            gen_ids=torch.tensor([r.gen_id for r in rows], dtype=torch.long),
            group_size=group_size,
            stats=dict(stats or {}),
        )
