"""The loss and off-policy settings of :class:`~unirl_lightning.modules.causal_lm.CausalLMModule`, as two
records built from the module's flat keyword arguments (the YAML keys). Each checks its values in
``__post_init__`` and refuses a combination that defines no loss, naming the keys; each computes what
its settings define: :meth:`PolicyLossSettings.surrogate` the policy loss, :meth:`MismatchCorrection.weights`
the importance weights of the rollout/trainer mismatch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from unirl_lightning.algorithms import (
    LossAggregation,
    PolicyLoss,
    RatioLevel,
    cispo_loss,
    masked_mean,
    ppo_clip_loss,
    sequence_masked_importance_weights,
    truncated_importance_weights,
)
from unirl_lightning.algorithms.kl import KLEstimator
from unirl_lightning.core.checks import require_at_least, require_choice, require_in_range, require_positive

__all__ = ["MismatchCorrection", "OldLogprob", "PolicyLossSettings"]

OldLogprob = Literal["rollout", "recompute"]


@dataclass(frozen=True)
class PolicyLossSettings:
    """What the policy loss is: ``loss`` (``"ppo"`` or ``"cispo"``), the clip range
    ``[1 - clip_low, 1 + clip_high]``, dual-clip ``clip_ratio_c``, ``ratio_level``, ``cispo_cap``,
    ``loss_aggregation``, the KL estimator and the entropy bonus (the module's docstring has each)."""

    loss: PolicyLoss = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    ratio_level: RatioLevel = "token"
    cispo_cap: float = 5.0
    loss_aggregation: LossAggregation = "token-mean"
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        require_in_range("clip_low", self.clip_low, 0, 1, high_open=True)
        require_at_least("clip_high", self.clip_high, 0)
        require_choice("loss", self.loss, PolicyLoss)
        require_choice("ratio_level", self.ratio_level, RatioLevel)
        self._check_combination()
        require_at_least("cispo_cap", self.cispo_cap, 1)
        require_choice("loss_aggregation", self.loss_aggregation, LossAggregation)
        require_choice("kl_estimator", self.kl_estimator, KLEstimator)
        require_at_least("entropy_coef", self.entropy_coef, 0)

    def _check_combination(self) -> None:
        """Refuse what defines no loss: dual-clip with CISPO or at the sequence level, and CISPO at the
        sequence level (its weight is a per-token truncated ratio)."""
        clip_ratio_c, ratio_level = self.clip_ratio_c, self.ratio_level
        if clip_ratio_c is not None:
            require_in_range("clip_ratio_c", clip_ratio_c, 1, math.inf, low_open=True, high_open=True)
            if ratio_level == "sequence":
                raise ValueError(
                    "clip_ratio_c (dual-clip) is defined at ratio_level='token' only: set clip_ratio_c=None "
                    f"(YAML: null) with ratio_level='sequence', got clip_ratio_c={clip_ratio_c!r}"
                )
            if self.loss == "cispo":
                raise ValueError(
                    "clip_ratio_c (dual-clip) is defined for loss='ppo' only (CISPO caps its weight at "
                    f"cispo_cap): set clip_ratio_c=None (YAML: null) with loss='cispo', got clip_ratio_c={clip_ratio_c!r}"
                )
        if self.loss == "cispo" and ratio_level != "token":
            raise ValueError(
                f"loss='cispo' is defined at ratio_level='token' only, got ratio_level={ratio_level!r}"
            )

    @property
    def token_mean(self) -> bool:
        """Whether the loss is a mean over tokens (global over the ranks), not over sequences."""
        return self.loss_aggregation == "token-mean"

    def surrogate(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        is_weights: torch.Tensor | None,
        token_penalty: torch.Tensor | None,
        max_tokens: int,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The configured policy loss with its metrics (``max_tokens``: the completion budget, the
        normaliser of ``"seq-mean-token-sum-norm"``)."""
        if self.loss == "cispo":
            return cispo_loss(
                logp,
                old_logp,
                advantages,
                mask,
                self.cispo_cap,
                self.loss_aggregation,
                is_weights,
                max_tokens=max_tokens,
                token_penalty=token_penalty,
            )
        return ppo_clip_loss(
            logp,
            old_logp,
            advantages,
            mask,
            self.clip_low,
            self.clip_high,
            self.loss_aggregation,
            is_weights,
            max_tokens=max_tokens,
            token_penalty=token_penalty,
            clip_ratio_c=self.clip_ratio_c,
            ratio_level=self.ratio_level,
        )


@dataclass(frozen=True)
class MismatchCorrection:
    """Which old log-probs the ratio is taken against (``old_logprob``) and how the rollout/trainer
    mismatch is corrected: per token, truncated (``tis_cap``), or per sequence, masked outside
    ``[1 / cap, cap]`` (``sequence_mask_cap``). Both need the trainer's own log-probs before the update
    (``old_logprob="recompute"``), and only one of them at a time."""

    old_logprob: OldLogprob = "rollout"
    tis_cap: float | None = None
    sequence_mask_cap: float | None = None

    def __post_init__(self) -> None:
        require_choice("old_logprob", self.old_logprob, OldLogprob)
        for key, cap in (("tis_cap", self.tis_cap), ("sequence_mask_cap", self.sequence_mask_cap)):
            if cap is not None and self.old_logprob != "recompute":
                raise ValueError(
                    f"{key} needs old_logprob='recompute' (the weights are pi_trainer / pi_rollout), got "
                    f"old_logprob={self.old_logprob!r}"
                )
        if self.tis_cap is not None and self.sequence_mask_cap is not None:
            raise ValueError(
                "tis_cap and sequence_mask_cap correct the same mismatch (per token, per sequence): set one, got "
                f"tis_cap={self.tis_cap!r}, sequence_mask_cap={self.sequence_mask_cap!r}"
            )
        if self.tis_cap is not None:
            require_positive("tis_cap", self.tis_cap)
        if self.sequence_mask_cap is not None:
            require_in_range(
                "sequence_mask_cap", self.sequence_mask_cap, 1, math.inf, low_open=True, high_open=True
            )

    @property
    def recompute(self) -> bool:
        """Whether the trainer recomputes its own log-probs before the update."""
        return self.old_logprob == "recompute"

    def weights(
        self, prox_logp: torch.Tensor | None, rollout_logp: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """The importance weights ``pi_trainer / pi_rollout`` (truncated per token, or per sequence and
        masked outside the band), or None without a correction; with their metrics
        (``mismatch_masked_fraction``: the sequences the mask left out)."""
        if self.tis_cap is not None:
            return truncated_importance_weights(prox_logp, rollout_logp, mask, self.tis_cap), {}
        if self.sequence_mask_cap is not None:
            weights, rejected = sequence_masked_importance_weights(
                prox_logp, rollout_logp, mask, self.sequence_mask_cap
            )
            return weights, {
                "mismatch_masked_fraction": masked_mean(rejected.float(), mask.bool().any(dim=-1))
            }
        return None, {}
