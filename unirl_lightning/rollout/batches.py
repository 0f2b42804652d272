"""The torch side of the rollout records: a diffusion sample's trajectory and the padded batches.

A batch's ``collate(groups)`` turns the groups a worker returned into the tensors of one training
step and computes the rollout statistics only its family has (e.g. completion length), so the loop
never inspects record types. The batches have ``to(device)`` and ``select(rows)``, so Lightning
moves them like any batch and the modules cut mini-batches from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch

from unirl_lightning.rollout.records import (
    Rollout,
    common_group_size,
)


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
