"""Off-policy correction for the rollout/trainer mismatch: truncated and masked importance sampling.

Contract: the rollout engine (vLLM, SGLang, HF generate) and the trainer compute slightly
different log-probs for the same tokens and weights (kernels, precision, or stale weights
under async rollout), so the samples come from a behaviour policy that is not the one being
trained. ``truncated_importance_weights`` (per token) and
``sequence_masked_importance_weights`` (per sequence) return ``[B, T]`` weights, detached, that
the caller multiplies into the per-token loss (``ppo_clip_loss(..., is_weights=w)``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _check_same_shape(trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> None:
    if rollout_logp.shape != trainer_logp.shape or mask.shape != trainer_logp.shape:
        raise ValueError(
            "trainer_logp, rollout_logp and mask must all have the same shape, got "
            f"trainer_logp={tuple(trainer_logp.shape)}, rollout_logp={tuple(rollout_logp.shape)}, "
            f"mask={tuple(mask.shape)}"
        )


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
    _check_same_shape(trainer_logp, rollout_logp, mask)
    valid = mask.bool()
    # log ratio zeroed on masked tokens before exp(), so padding garbage cannot overflow
    log_ratio = torch.where(valid, trainer_logp.detach() - rollout_logp.detach(), 0.0)
    weights = torch.clamp(torch.exp(log_ratio), max=cap)
    return torch.where(valid, weights, 0.0)


def sequence_masked_importance_weights(
    trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float = 2.0
) -> tuple[Tensor, Tensor]:
    """Sequence-level masked importance sampling: ``w_i = rho_i`` if ``1/cap <= rho_i <= cap``, else 0.

    ``rho_i = exp(sum_t (trainer_logp - rollout_logp))`` over the valid tokens of sequence ``i``
    (the sequence's likelihood ratio, *not* a per-token mean), broadcast to its tokens. A
    sequence whose ratio leaves ``[1/cap, cap]`` is dropped from the loss (weight 0); one
    inside keeps its ratio as weight. This is TRL's ``vllm_importance_sampling_mode=
    "sequence_mask"`` (``GRPOTrainer._generate_and_score_completions``:
    ``per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)``, ``exp``, then
    ``masked_fill`` to 0 below ``vllm_importance_sampling_clip_min`` and above ``..._clip_max``)
    with ``clip_min = 1 / cap``, ``clip_max = cap``. The band test is done on the log ratio
    (``|log rho_i| <= log cap``), so a long sequence whose ratio overflows float32 is masked,
    never ``inf``.

    Args:
        trainer_logp: ``[B, T]`` the trainer's log-probs before the update (recomputed);
            detached here.
        rollout_logp: ``[B, T]`` behaviour log-probs reported by the rollout engine.
        mask: ``[B, T]`` bool or 0/1.
        cap: the band ``[1/cap, cap]``, ``cap > 1``.

    Returns:
        ``(weights, rejected)``: ``[B, T]`` weights, detached, 0 where ``mask`` is 0; and
        ``[B]`` bool, True for a sequence with a valid token whose ratio left the band.
    """
    if not cap > 1:
        raise ValueError(f"cap must be > 1, got {cap!r}")
    _check_same_shape(trainer_logp, rollout_logp, mask)
    valid = mask.bool()
    log_ratio = torch.where(valid, trainer_logp.detach() - rollout_logp.detach(), 0.0).sum(dim=-1)
    kept = log_ratio.abs() <= math.log(cap)
    weights = torch.where(kept, torch.exp(torch.clamp(log_ratio, max=math.log(cap))), 0.0)
    return torch.where(valid, weights.unsqueeze(-1), 0.0), ~kept & valid.any(dim=-1)
