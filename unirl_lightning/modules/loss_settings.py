"""The loss and off-policy settings of :class:`~unirl_lightning.modules.causal_lm.CausalLMModule` that
only make sense together: each check refuses a combination that defines no loss, naming the keys."""

from __future__ import annotations

import math

from unirl_lightning.checks import require_in_range, require_positive

__all__ = ["check_loss_combination", "check_mismatch_correction"]


def check_loss_combination(loss: str, ratio_level: str, clip_ratio_c: float | None) -> None:
    """Refuse the settings that define no loss: dual-clip with CISPO or at the sequence level, and
    CISPO at the sequence level (its weight is a per-token truncated ratio)."""
    if clip_ratio_c is not None:
        require_in_range("clip_ratio_c", clip_ratio_c, 1, math.inf, low_open=True, high_open=True)
        if ratio_level == "sequence":
            raise ValueError(
                "clip_ratio_c (dual-clip) is defined at ratio_level='token' only: set clip_ratio_c=None "
                f"(YAML: null) with ratio_level='sequence', got clip_ratio_c={clip_ratio_c!r}"
            )
        if loss == "cispo":
            raise ValueError(
                "clip_ratio_c (dual-clip) is defined for loss='ppo' only (CISPO caps its weight at "
                f"cispo_cap): set clip_ratio_c=None (YAML: null) with loss='cispo', got clip_ratio_c={clip_ratio_c!r}"
            )
    if loss == "cispo" and ratio_level != "token":
        raise ValueError(
            f"loss='cispo' is defined at ratio_level='token' only, got ratio_level={ratio_level!r}"
        )


def check_mismatch_correction(
    old_logprob: str, tis_cap: float | None, sequence_mask_cap: float | None
) -> None:
    """The rollout/trainer mismatch corrections need the trainer's own log-probs before the update
    (``old_logprob="recompute"``), and one of them at a time."""
    for key, cap in (("tis_cap", tis_cap), ("sequence_mask_cap", sequence_mask_cap)):
        if cap is not None and old_logprob != "recompute":
            raise ValueError(
                f"{key} needs old_logprob='recompute' (the weights are pi_trainer / pi_rollout), got "
                f"old_logprob={old_logprob!r}"
            )
    if tis_cap is not None and sequence_mask_cap is not None:
        raise ValueError(
            "tis_cap and sequence_mask_cap correct the same mismatch (per token, per sequence): set one, got "
            f"tis_cap={tis_cap!r}, sequence_mask_cap={sequence_mask_cap!r}"
        )
    if tis_cap is not None:
        require_positive("tis_cap", tis_cap)
    if sequence_mask_cap is not None:
        require_in_range("sequence_mask_cap", sequence_mask_cap, 1, math.inf, low_open=True, high_open=True)
