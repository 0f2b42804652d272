"""Off-policy correction for the rollout/trainer mismatch: truncated importance sampling.

Contract: the rollout engine (vLLM, SGLang, HF generate) and the trainer compute slightly
different log-probs for the same tokens and weights (kernels, precision, or stale weights
under async rollout), so the samples come from a behaviour policy that is not the one being
trained. ``truncated_importance_weights`` returns per-token weights, detached, that the
caller multiplies into the per-token loss (``ppo_clip_loss(..., is_weights=w)``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def truncated_importance_weights(
    trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float = 2.0
) -> Tensor:
    """Per-token truncated importance weights ``w = min(pi_trainer / pi_rollout, cap)``.

    TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training"): the cap bounds the variance that a few tokens with a large ratio would add.

    Args:
        trainer_logp: ``[B, T]`` log-probs from the trainer (the ``old_logp`` of the PPO
            ratio); detached here.
        rollout_logp: ``[B, T]`` behaviour log-probs reported by the rollout engine.
        mask: ``[B, T]`` bool or 0/1.
        cap: truncation threshold, ``> 0``.

    Returns:
        ``[B, T]`` weights, detached, 0 where ``mask`` is 0.
    """
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap!r}")
    if rollout_logp.shape != trainer_logp.shape or mask.shape != trainer_logp.shape:
        raise ValueError(
            "trainer_logp, rollout_logp and mask must all have the same shape, got "
            f"trainer_logp={tuple(trainer_logp.shape)}, rollout_logp={tuple(rollout_logp.shape)}, "
            f"mask={tuple(mask.shape)}"
        )
    valid = mask.bool()
    # log ratio zeroed on masked tokens before exp(), so padding garbage cannot overflow
    log_ratio = torch.where(valid, trainer_logp.detach() - rollout_logp.detach(), 0.0)
    weights = torch.clamp(torch.exp(log_ratio), max=cap)
    return torch.where(valid, weights, 0.0)
