"""Policy-gradient losses: PPO-clip (with DAPO clip-higher and truncated IS) and GSPO.

Contract: inputs are per-token ``[B, T]`` tensors with a ``mask`` (1/True on tokens that are
trained on, 0/False on prompt and padding). Masked positions never reach the loss, the
metrics or the gradient, even if they hold ``inf``/``nan``. ``old_logp``, ``advantages`` and
importance weights are treated as constants (detached); the gradient flows to ``logp`` only.
Each loss returns ``(loss, metrics)``: a scalar to minimise and a dict of detached scalars
named like CleanRL's (``ratio_mean``, ``clip_fraction``, ``approx_kl``) for logging.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is set.

    Masked positions are selected out with ``torch.where`` (not multiplied by 0), so an
    ``inf``/``nan`` there cannot leak. An all-masked slice gives 0 rather than NaN.

    Args:
        x: any shape.
        mask: same shape as ``x``; bool or 0/1.
        dim: dims to reduce; ``None`` reduces all of them to a scalar.

    Returns:
        ``x`` reduced over ``dim``.
    """
    if mask.shape != x.shape:
        raise ValueError(f"mask must have the shape of x {tuple(x.shape)}, got {tuple(mask.shape)}")
    valid = mask.bool()
    total = torch.where(valid, x, 0.0).sum() if dim is None else torch.where(valid, x, 0.0).sum(dim=dim)
    count = valid.sum() if dim is None else valid.sum(dim=dim)
    return total / count.clamp(min=1)


def aggregate_loss(loss_tokens: Tensor, mask: Tensor, mode: str) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    Modes:
        ``"token-mean"``: sum over all valid tokens / number of valid tokens (every token
            weighs the same; DAPO).
        ``"seq-mean-token-mean"``: mean over each sequence's valid tokens, then mean over the
            sequences that have at least one (every sequence weighs the same; original GRPO).
        ``"seq-mean-token-sum-norm"``: sum over each sequence's valid tokens divided by the
            constant ``T = mask.shape[1]`` (the max length), then mean over all ``B``
            sequences (Dr.GRPO, Liu et al. 2025: no length bias from a per-sequence divisor).

    Args:
        loss_tokens: ``[B, T]`` per-token loss.
        mask: ``[B, T]`` bool or 0/1.
        mode: one of ``LOSS_AGGREGATIONS``.

    Returns:
        Scalar loss.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"aggregation mode must be one of {LOSS_AGGREGATIONS}, got {mode!r}")
    if loss_tokens.dim() != 2:
        raise ValueError(f"loss_tokens must be [B, T], got shape {tuple(loss_tokens.shape)}")
    if mode == "token-mean":
        return masked_mean(loss_tokens, mask)
    if mode == "seq-mean-token-mean":
        seq_losses = masked_mean(loss_tokens, mask, dim=-1)
        return masked_mean(seq_losses, mask.bool().any(dim=-1))
    # seq-mean-token-sum-norm: constant divisor, Dr.GRPO
    seq_losses = torch.where(mask.bool(), loss_tokens, 0.0).sum(dim=-1) / mask.shape[1]
    return seq_losses.mean()


def _check_per_token(logp: Tensor, old_logp: Tensor, mask: Tensor) -> None:
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(
            "logp, old_logp and mask must all be [B, T] with the same shape, got "
            f"logp={tuple(logp.shape)}, old_logp={tuple(old_logp.shape)}, mask={tuple(mask.shape)}"
        )


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low!r}")
    if not clip_high >= 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high!r}")


def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: str = "token-mean",
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level PPO clipped surrogate (Schulman et al. 2017) with asymmetric clipping.

    ``ratio = exp(logp - old_logp)``; ``pg_loss1 = -A * ratio``;
    ``pg_loss2 = -A * clamp(ratio, 1 - clip_low, 1 + clip_high)`` (clip-higher: a larger
    ``clip_high`` lets unlikely tokens grow, DAPO, Yu et al. 2025);
    ``loss_tokens = max(pg_loss1, pg_loss2)``, times ``is_weights`` if given (truncated
    importance sampling for the rollout/trainer mismatch, see ``correction.py``), then reduced
    with ``aggregate_loss(..., aggregation)``.

    Args:
        logp: ``[B, T]`` log-probs of the current policy (carries the gradient).
        old_logp: ``[B, T]`` log-probs of the policy the advantages were computed for.
        advantages: ``[B]`` (one per sequence, broadcast over tokens) or ``[B, T]``.
        mask: ``[B, T]`` bool or 0/1.
        clip_low: lower clip range, in ``[0, 1)``.
        clip_high: upper clip range, ``>= 0``.
        aggregation: one of ``LOSS_AGGREGATIONS``.
        is_weights: optional ``[B, T]`` per-token importance weights, detached here.

    Returns:
        ``(loss, metrics)``; metrics are detached scalars: ``ratio_mean`` (masked mean of the
        ratio), ``clip_fraction`` (masked fraction of tokens where the clipped term was taken,
        i.e. ``pg_loss2 > pg_loss1``, so the token's gradient is 0) and ``approx_kl``
        (masked mean of the k3 estimator ``(ratio - 1) - log ratio``, Schulman 2020).
    """
    _check_per_token(logp, old_logp, mask)
    _check_clip(clip_low, clip_high)
    if advantages.shape == logp.shape[:1]:
        advantages = advantages.unsqueeze(-1)
    elif advantages.shape != logp.shape:
        raise ValueError(
            f"advantages must be [B] = {tuple(logp.shape[:1])} or [B, T] = {tuple(logp.shape)}, "
            f"got {tuple(advantages.shape)}"
        )
    if is_weights is not None and is_weights.shape != logp.shape:
        raise ValueError(f"is_weights must be [B, T] = {tuple(logp.shape)}, got {tuple(is_weights.shape)}")
    valid = mask.bool()
    advantages = advantages.detach()

    # log ratio zeroed on masked tokens first, so exp() never makes an inf whose gradient is nan
    log_ratio = torch.where(valid, logp - old_logp.detach(), 0.0)
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_tokens = torch.max(pg_loss1, pg_loss2)
    if is_weights is not None:
        loss_tokens = loss_tokens * is_weights.detach()
    loss = aggregate_loss(loss_tokens, mask, aggregation)

    with torch.no_grad():
        approx_kl = (ratio - 1) - log_ratio  # k3 estimator, Schulman 2020
        metrics = {
            "ratio_mean": masked_mean(ratio, valid),
            "clip_fraction": masked_mean((pg_loss2 > pg_loss1).float(), valid),
            "approx_kl": masked_mean(approx_kl, valid),
        }
    return loss, metrics


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Sequence-level clipped surrogate (GSPO, Zheng et al. 2025).

    The importance ratio is per *sequence*, the geometric mean of the token ratios:
    ``seq_ratio = exp(masked_mean_t(logp - old_logp))`` (length-normalised, hence the tiny
    default clip ranges). ``pg_loss1 = -A * seq_ratio``,
    ``pg_loss2 = -A * clamp(seq_ratio, 1 - clip_low, 1 + clip_high)``,
    ``loss = mean over sequences of max(pg_loss1, pg_loss2)`` (sequences without a valid
    token are left out).

    Args:
        logp: ``[B, T]`` log-probs of the current policy (carries the gradient).
        old_logp: ``[B, T]`` log-probs of the behaviour policy.
        advantages: ``[B]``, one per sequence.
        mask: ``[B, T]`` bool or 0/1.
        clip_low: lower clip range, in ``[0, 1)``.
        clip_high: upper clip range, ``>= 0``.

    Returns:
        ``(loss, metrics)``; metrics are detached scalars: ``ratio_mean`` (mean sequence
        ratio), ``clip_fraction`` (fraction of sequences clipped) and ``approx_kl`` (masked
        mean over tokens of the per-token k3 estimator, comparable with ``ppo_clip_loss``).
    """
    _check_per_token(logp, old_logp, mask)
    _check_clip(clip_low, clip_high)
    if advantages.shape != logp.shape[:1]:
        raise ValueError(
            f"advantages must be [B] = {tuple(logp.shape[:1])} (one per sequence), got {tuple(advantages.shape)}"
        )
    valid = mask.bool()
    has_tokens = valid.any(dim=-1)
    advantages = advantages.detach()

    log_ratio = torch.where(valid, logp - old_logp.detach(), 0.0)
    seq_ratio = torch.exp(masked_mean(log_ratio, valid, dim=-1))  # geometric mean of token ratios
    pg_loss1 = -advantages * seq_ratio
    pg_loss2 = -advantages * torch.clamp(seq_ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = masked_mean(torch.max(pg_loss1, pg_loss2), has_tokens)

    with torch.no_grad():
        approx_kl = (torch.exp(log_ratio) - 1) - log_ratio  # k3 estimator, Schulman 2020
        metrics = {
            "ratio_mean": masked_mean(seq_ratio, has_tokens),
            "clip_fraction": masked_mean((pg_loss2 > pg_loss1).float(), has_tokens),
            "approx_kl": masked_mean(approx_kl, valid),
        }
    return loss, metrics
