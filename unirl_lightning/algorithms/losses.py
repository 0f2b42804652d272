"""Policy-gradient losses: PPO-clip (with DAPO clip-higher and truncated IS) and GSPO.

Contract: inputs are per-token ``[B, T]`` tensors with a ``mask`` (1/True on tokens that are
trained on, 0/False on prompt and padding). Masked positions never reach the loss, the
metrics or the gradient, even if they hold ``inf``/``nan``. ``old_logp``, ``advantages`` and
importance weights are treated as constants (detached); the gradient flows to ``logp`` only.
Each loss returns ``(loss, metrics)``: a scalar to minimise and a dict of detached scalars
named like CleanRL's (``ratio_mean``, ``clip_fraction``, ``approx_kl``) for logging.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)


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


def aggregate_loss(
    loss_tokens: Tensor, mask: Tensor, mode: LossAggregation, max_tokens: int | None = None
) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    Modes (TRL ``loss_type`` / verl ``loss_agg_mode`` in brackets):
        ``"token-mean"``: sum over all valid tokens / number of valid tokens (every token
            weighs the same; DAPO) [TRL ``"bnpo"``, and ``"dapo"`` on one device without
            gradient accumulation; verl ``"token-mean"``].
        ``"seq-mean-token-mean"``: mean over each sequence's valid tokens, then mean over
            *all* ``B`` sequences; a sequence with no valid token counts as 0 (every sequence
            weighs ``1 / B`` whatever the others hold; original GRPO) [TRL ``"grpo"``, which
            also divides by all rows; verl ``"seq-mean-token-mean"`` divides by the non-empty
            rows instead].
        ``"seq-mean-token-sum-norm"``: sum over each sequence's valid tokens divided by the
            constant ``max_tokens``, then mean over all ``B`` sequences (Dr.GRPO, Liu et al.
            2025: no length bias from a per-sequence divisor) [TRL ``"dr_grpo"``, which
            divides by ``B * max_completion_length``; verl ``"seq-mean-token-sum-norm"``
            with ``loss_scale_factor``, which sums rather than averages the sequences].
            ``max_tokens`` is the generation budget (``max_new_tokens``), *not* the padded
            width ``T``: the width varies with the prompts and padding of each batch, and so
            would the effective learning rate.

    Args:
        loss_tokens: ``[B, T]`` per-token loss.
        mask: ``[B, T]`` bool or 0/1.
        mode: one of ``LOSS_AGGREGATIONS``.
        max_tokens: the constant divisor of ``"seq-mean-token-sum-norm"`` (required there, an
            int ``>= 1``); ignored by the other modes, so a caller may always pass it.

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
        # empty sequences count as 0 in the mean over all B (as TRL's "grpo")
        return masked_mean(loss_tokens, mask, dim=-1).mean()
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(
            "aggregation 'seq-mean-token-sum-norm' needs max_tokens, the generation budget "
            f"(max_new_tokens), as an int >= 1, got {max_tokens!r}"
        )
    # constant divisor, Dr.GRPO
    seq_losses = torch.where(mask.bool(), loss_tokens, 0.0).sum(dim=-1) / max_tokens
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
    aggregation: LossAggregation = "token-mean",
    is_weights: Tensor | None = None,
    *,
    max_tokens: int | None = None,
    token_penalty: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level PPO clipped surrogate (Schulman et al. 2017) with asymmetric clipping.

    In the order it runs: ``ratio = exp(logp - old_logp)``; ``pg_loss1 = -A * ratio``;
    ``pg_loss2 = -A * clamp(ratio, 1 - clip_low, 1 + clip_high)`` (clip-higher: a larger
    ``clip_high`` lets unlikely tokens grow, DAPO, Yu et al. 2025);
    ``loss_tokens = max(pg_loss1, pg_loss2)``, times ``is_weights`` if given (truncated
    importance sampling for the rollout/trainer mismatch, see ``correction.py``), plus
    ``token_penalty`` if given, then reduced with ``aggregate_loss(..., aggregation, max_tokens)``.

    ``token_penalty`` is where a KL to the reference goes (``kl_coef * kl_penalty(logp,
    ref_logp, mask=mask)``): added per token *before* aggregation, so it is weighted like the
    policy term (per sequence under ``"seq-mean-token-mean"``, over ``max_tokens`` under
    ``"seq-mean-token-sum-norm"``), and *after* the importance weights, so it is not
    reweighted by them. This is TRL's ``GRPOTrainer._compute_loss`` order: ``per_token_loss``
    = ``-min(coef_1 * A, coef_2 * A)``, times the vLLM ``importance_sampling_ratio``, plus
    ``beta * per_token_kl`` (k3, not multiplied by ``coef_1`` unless
    ``use_bias_correction_kl``), then masked and aggregated per ``loss_type``. verl adds
    ``kl_coef * agg_loss(kld, loss_agg_mode)`` to ``agg_loss(pg_losses * rollout_is_weights)``,
    the same number since the aggregation is linear in the per-token loss.

    Args:
        logp: ``[B, T]`` log-probs of the current policy (carries the gradient).
        old_logp: ``[B, T]`` log-probs of the policy the advantages were computed for.
        advantages: ``[B]`` (one per sequence, broadcast over tokens) or ``[B, T]``.
        mask: ``[B, T]`` bool or 0/1.
        clip_low: lower clip range, in ``[0, 1)``.
        clip_high: upper clip range, ``>= 0``.
        aggregation: one of ``LOSS_AGGREGATIONS``.
        is_weights: optional ``[B, T]`` per-token importance weights, detached here.
        max_tokens: the generation budget; required by ``"seq-mean-token-sum-norm"`` (see
            ``aggregate_loss``).
        token_penalty: optional ``[B, T]`` per-token term added to the loss, already scaled by
            its coefficient; its gradient flows. Masked positions are selected out, but keep
            them finite (``kl_penalty(..., mask=mask)`` does): ``where`` cannot stop a nan
            gradient made inside the caller's own computation.

    Returns:
        ``(loss, metrics)``; metrics are detached scalars: ``pg_loss`` (the aggregated clipped
        surrogate alone, without ``token_penalty``), ``ratio_mean`` (masked mean of the ratio),
        ``clip_fraction`` (masked fraction of tokens where the clipped term was taken, i.e.
        ``pg_loss2 > pg_loss1``, so the token's gradient is 0) and ``approx_kl`` (masked mean
        of the k3 estimator ``(ratio - 1) - log ratio``, Schulman 2020).
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
    if token_penalty is not None and token_penalty.shape != logp.shape:
        raise ValueError(
            f"token_penalty must be [B, T] = {tuple(logp.shape)}, got {tuple(token_penalty.shape)}"
        )
    valid = mask.bool()
    advantages = advantages.detach()

    # log ratio zeroed on masked tokens first, so exp() never makes an inf whose gradient is nan
    log_ratio = torch.where(valid, logp - old_logp.detach(), 0.0)
    ratio = torch.exp(log_ratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg_loss_tokens = torch.max(pg_loss1, pg_loss2)
    if is_weights is not None:
        pg_loss_tokens = pg_loss_tokens * is_weights.detach()
    loss_tokens = pg_loss_tokens if token_penalty is None else pg_loss_tokens + token_penalty
    loss = aggregate_loss(loss_tokens, mask, aggregation, max_tokens)

    with torch.no_grad():
        approx_kl = (ratio - 1) - log_ratio  # k3 estimator, Schulman 2020
        metrics = {
            "pg_loss": loss.detach()
            if token_penalty is None
            else aggregate_loss(pg_loss_tokens, mask, aggregation, max_tokens),
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
    ``loss = mean over all B sequences of max(pg_loss1, pg_loss2)``, a sequence without a
    valid token counting as 0 (as ``aggregate_loss(..., "seq-mean-token-mean")`` and TRL's
    ``importance_sampling_level="sequence"`` with ``loss_type="grpo"``).

    Args:
        logp: ``[B, T]`` log-probs of the current policy (carries the gradient).
        old_logp: ``[B, T]`` log-probs of the behaviour policy.
        advantages: ``[B]``, one per sequence.
        mask: ``[B, T]`` bool or 0/1.
        clip_low: lower clip range, in ``[0, 1)``.
        clip_high: upper clip range, ``>= 0``.

    Returns:
        ``(loss, metrics)``; metrics are detached scalars: ``ratio_mean`` (mean sequence
        ratio) and ``clip_fraction`` (fraction of sequences clipped), both over the sequences
        with a valid token, and ``approx_kl`` (masked
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
    loss = torch.where(has_tokens, torch.max(pg_loss1, pg_loss2), 0.0).mean()

    with torch.no_grad():
        approx_kl = (torch.exp(log_ratio) - 1) - log_ratio  # k3 estimator, Schulman 2020
        metrics = {
            "ratio_mean": masked_mean(seq_ratio, has_tokens),
            "clip_fraction": masked_mean((pg_loss2 > pg_loss1).float(), has_tokens),
            "approx_kl": masked_mean(approx_kl, valid),
        }
    return loss, metrics
