"""The state of one RL step's update: what a module computes once per batch, before any update, with
one row per batch row. A mini-batch takes its rows with :meth:`StepContext.select`, a micro-batch cut
to its longest row also takes its columns with :meth:`StepContext.narrow`. One record per family:

* :class:`TokenContext` (GRPO on causal LMs): advantages, the proximal (pre-update trainer) and
  reference log-probs, the rows the loss keeps;
* :class:`PPOContext`: the same, plus the critic's values before the update and the GAE returns;
* :class:`FlowContext` (Flow-GRPO): advantages, the SDE steps trained on, and the conditioning.

A field that is None (a log-prob the settings do not need) stays None under both.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

__all__ = ["FlowContext", "PPOContext", "StepContext", "TokenContext"]


def _rows(value: Any, rows: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor):
        return value[rows]
    if isinstance(value, dict):
        return {key: _rows(v, rows) for key, v in value.items()}
    return value


def _columns(value: Any, columns: int, width: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == columns:
        return value[:, :width]
    return value


@dataclass
class StepContext:
    """What every family's update reads: the advantages, per row ``[N]`` or per token ``[N, L-1]``."""

    advantages: torch.Tensor | None = None

    def select(self, rows: torch.Tensor) -> StepContext:
        """The context of batch rows ``rows`` (every tensor, those in a dict too, indexed by them)."""
        return replace(self, **{f.name: _rows(getattr(self, f.name), rows) for f in fields(self)})

    def narrow(self, columns: int, width: int) -> StepContext:
        """Every per-token tensor (``[N, columns]``) cut to its first ``width`` columns: a micro-batch
        cut to its longest row drops only right padding."""
        return replace(
            self, **{f.name: _columns(getattr(self, f.name), columns, width) for f in fields(self)}
        )


@dataclass
class TokenContext(StepContext):
    """A causal-LM step: ``prox_logp`` (the trainer's log-probs before the step, with
    ``old_logprob="recompute"``) and ``ref_logp`` (the reference's, with a KL term), ``[N, L-1]``;
    ``trained_rows`` (``[N]`` bool, with ``mask_truncated``: the rows the loss keeps)."""

    prox_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    trained_rows: torch.Tensor | None = None


@dataclass
class PPOContext(TokenContext):
    """A PPO step: a :class:`TokenContext` plus the critic's values before the update and the GAE
    returns, ``[N, L-1]``."""

    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None


@dataclass
class FlowContext(StepContext):
    """A Flow-GRPO step: the recorded SDE steps trained on, and every row's conditioning (``cond``)
    and, under classifier-free guidance, its null conditioning (``null``), as the pipeline encodes them."""

    train_steps: list[int] = field(default_factory=list)
    cond: dict[str, torch.Tensor] = field(default_factory=dict)
    null: dict[str, torch.Tensor] | None = None
