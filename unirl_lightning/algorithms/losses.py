"""Policy-gradient losses: PPO-clip (token or sequence ratios, clip-higher, dual-clip) and CISPO.

Contract: inputs are per-token ``[B, T]`` tensors with a ``mask`` (1/True on tokens that are
trained on, 0/False on prompt and padding). Masked positions never reach the loss, the
metrics or the gradient, even if they hold ``inf``/``nan``. ``old_logp``, ``advantages`` and
importance weights are treated as constants (detached); the gradient flows to ``logp`` only.
Every log ratio is clamped to ``[-20, 20]`` before ``exp`` (verl ``compute_policy_loss``), so a
very stale sample or a bf16 mismatch gives a large but finite ratio, never ``inf``/``nan``.
Each loss returns ``(loss, metrics)``: a scalar to minimise and a dict of detached scalars
named like CleanRL's (``ratio_mean``, ``clip_fraction``, ``approx_kl``) for logging.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)
PolicyLoss = Literal["ppo", "cispo"]
POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLoss)
RatioLevel = Literal["token", "sequence"]
RATIO_LEVELS: tuple[str, ...] = get_args(RatioLevel)

LOG_RATIO_BOUND = 20.0
"""``|log(pi / pi_old)|`` is clamped to this before ``exp`` (verl: ``clamp(negative_approx_kl, -20, 20)``)."""


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


def safe_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token ``log(pi / pi_old) = logp - old_logp``, 0 on masked tokens, clamped to ``[-20, 20]``.

    Zeroed on masked tokens *before* anything else, so padding garbage cannot overflow (its
    gradient would be nan); clamped as verl's ``compute_policy_loss`` does
    (``torch.clamp(negative_approx_kl, min=-20.0, max=20.0)``), so ``exp`` of it is finite
    (at most ``e^20``, about ``4.9e8``) and a clamped token gets no gradient. ``old_logp`` is
    detached.
    """
    log_ratio = torch.where(mask.bool(), logp - old_logp.detach(), 0.0)
    return torch.clamp(log_ratio, min=-LOG_RATIO_BOUND, max=LOG_RATIO_BOUND)


def sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """GSPO's sequence log ratio ``[B]``: the masked mean of the token log ratios (the log of
    the geometric mean of the token ratios, Zheng et al. 2025); 0 for a sequence without a
    valid token. TRL: ``(log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)``."""
    return masked_mean(log_ratio, mask, dim=-1)


def dual_clip(clipped_loss: Tensor, advantages: Tensor, clip_ratio_c: float) -> Tensor:
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL").

    For ``A < 0`` the clipped surrogate ``max(-A r, -A clip(r))`` grows without bound with the
    ratio ``r``; dual-clip caps it at ``-A * c``: ``loss = min(max(pg1, pg2), -A * c)`` where
    ``A < 0``, unchanged where ``A >= 0``. verl ``compute_policy_loss``: ``pg_losses3 =
    -advantages * clip_ratio_c``; ``clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)``;
    ``pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)``. A capped
    token gets no gradient.
    """
    return torch.where(advantages < 0, torch.min(clipped_loss, -advantages * clip_ratio_c), clipped_loss)


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


def _token_advantages(advantages: Tensor, logp: Tensor) -> Tensor:
    """``[B]`` advantages as ``[B, 1]`` (broadcast over tokens) or ``[B, T]`` as they are, detached."""
    if advantages.shape == logp.shape[:1]:
        return advantages.detach().unsqueeze(-1)
    if advantages.shape != logp.shape:
        raise ValueError(
            f"advantages must be [B] = {tuple(logp.shape[:1])} or [B, T] = {tuple(logp.shape)}, "
            f"got {tuple(advantages.shape)}"
        )
    return advantages.detach()


def _check_token_terms(logp: Tensor, is_weights: Tensor | None, token_penalty: Tensor | None) -> None:
    if is_weights is not None and is_weights.shape != logp.shape:
        raise ValueError(f"is_weights must be [B, T] = {tuple(logp.shape)}, got {tuple(is_weights.shape)}")
    if token_penalty is not None and token_penalty.shape != logp.shape:
        raise ValueError(
            f"token_penalty must be [B, T] = {tuple(logp.shape)}, got {tuple(token_penalty.shape)}"
        )


def _reduce(
    pg_loss_tokens: Tensor,
    mask: Tensor,
    aggregation: LossAggregation,
    max_tokens: int | None,
    is_weights: Tensor | None,
    token_penalty: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """TRL's order from the policy term on: ``x is_weights`` -> ``+ token_penalty`` -> aggregate.

    Returns ``(loss, pg_loss)``: the loss, and the aggregated policy term alone (detached)."""
    if is_weights is not None:
        pg_loss_tokens = pg_loss_tokens * is_weights.detach()
    loss_tokens = pg_loss_tokens if token_penalty is None else pg_loss_tokens + token_penalty
    loss = aggregate_loss(loss_tokens, mask, aggregation, max_tokens)
    with torch.no_grad():
        pg_loss = (
            loss.detach()
            if token_penalty is None
            else aggregate_loss(pg_loss_tokens, mask, aggregation, max_tokens)
        )
    return loss, pg_loss


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
    clip_ratio_c: float | None = None,
    ratio_level: RatioLevel = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with asymmetric clipping, per token or per sequence.

    In the order it runs: ``ratio = exp(safe_log_ratio(logp, old_logp))`` per token
    (``ratio_level="token"``) or ``exp(sequence_log_ratio(...))`` per sequence
    (``ratio_level="sequence"``, GSPO, Zheng et al. 2025: the geometric mean of the token
    ratios, broadcast to the sequence's tokens; TRL ``importance_sampling_level="sequence"``);
    ``pg_loss1 = -A * ratio``; ``pg_loss2 = -A * clamp(ratio, 1 - clip_low, 1 + clip_high)``
    (clip-higher: a larger ``clip_high`` lets unlikely tokens grow, DAPO, Yu et al. 2025);
    ``max(pg_loss1, pg_loss2)``, capped at ``-A * clip_ratio_c`` where ``A < 0`` if
    ``clip_ratio_c`` is set (:func:`dual_clip`); times ``is_weights`` if given (importance
    weights for the rollout/trainer mismatch, see ``correction.py``), plus ``token_penalty``
    if given, then reduced with ``aggregate_loss(..., aggregation, max_tokens)``.

    ``token_penalty`` is where a KL to the reference goes (``kl_coef * kl_penalty(logp,
    ref_logp, mask=mask)``), and an entropy bonus (``-entropy_coef * entropy``): added per token
    *before* aggregation, so it is weighted like the policy term (per sequence under
    ``"seq-mean-token-mean"``, over ``max_tokens`` under ``"seq-mean-token-sum-norm"``), and
    *after* the importance weights, so it is not reweighted by them (TRL's and verl's order; the
    README's loss table compares the two).

    Args:
        logp: ``[B, T]`` log-probs of the current policy (carries the gradient).
        old_logp: ``[B, T]`` log-probs of the policy the advantages were computed for.
        advantages: ``[B]`` (one per sequence, broadcast over tokens) or ``[B, T]``; ``[B]``
            only at ``ratio_level="sequence"``.
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
        clip_ratio_c: dual-clip constant, ``> 1``; None = off (the default here; modules
            default to 3.0). Token level only: GSPO defines no dual clip.
        ratio_level: ``"token"`` or ``"sequence"`` (GSPO; use its small clip ranges, e.g.
            ``3e-4`` / ``4e-4``).

    Returns:
        ``(loss, metrics)``; metrics are detached scalars: ``pg_loss`` (the aggregated policy
        term alone, without ``token_penalty``), ``ratio_mean`` (masked mean of the ratio),
        ``clip_fraction`` (masked fraction where the clipped term was taken, i.e.
        ``pg_loss2 > pg_loss1``, so the gradient is 0), with ``clip_ratio_c`` also
        ``dual_clip_fraction`` (masked fraction with ``A < 0`` where the cap ``-A * c`` was
        taken, verl's ``pg_clipfrac_lower``), and ``approx_kl`` (masked mean over tokens of the
        k3 estimator ``(r - 1) - log r`` of the token ratios, Schulman 2020). At
        ``ratio_level="sequence"`` the ratio and clip figures are over the sequences with a
        valid token.
    """
    _check_per_token(logp, old_logp, mask)
    _check_clip(clip_low, clip_high)
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    if clip_ratio_c is not None:
        if not clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (or None: no dual clip), got {clip_ratio_c!r}")
        if ratio_level == "sequence":
            raise ValueError(
                f"clip_ratio_c (dual-clip) is defined for ratio_level='token' only, got "
                f"clip_ratio_c={clip_ratio_c!r} with ratio_level='sequence'"
            )
    _check_token_terms(logp, is_weights, token_penalty)
    valid = mask.bool()
    log_ratio = safe_log_ratio(logp, old_logp, valid)

    if ratio_level == "token":
        advantages = _token_advantages(advantages, logp)
        ratio, units = torch.exp(log_ratio), valid
    else:
        if advantages.shape != logp.shape[:1]:
            raise ValueError(
                f"advantages must be [B] = {tuple(logp.shape[:1])} (one per sequence), got "
                f"{tuple(advantages.shape)}"
            )
        advantages = advantages.detach()
        ratio, units = torch.exp(sequence_log_ratio(log_ratio, valid)), valid.any(dim=-1)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.max(pg_loss1, pg_loss2)
    pg_losses = clipped if clip_ratio_c is None else dual_clip(clipped, advantages, clip_ratio_c)
    pg_loss_tokens = pg_losses if ratio_level == "token" else pg_losses.unsqueeze(-1).expand_as(logp)
    loss, pg_loss = _reduce(pg_loss_tokens, mask, aggregation, max_tokens, is_weights, token_penalty)

    with torch.no_grad():
        approx_kl = (torch.exp(log_ratio) - 1) - log_ratio  # k3 estimator, Schulman 2020
        metrics = {
            "pg_loss": pg_loss,
            "ratio_mean": masked_mean(ratio.expand_as(units), units),
            "clip_fraction": masked_mean((pg_loss2 > pg_loss1).float(), units),
            "approx_kl": masked_mean(approx_kl, valid),
        }
        if clip_ratio_c is not None:
            capped = (advantages < 0) & (clipped > -advantages * clip_ratio_c)
            metrics["dual_clip_fraction"] = masked_mean(capped.float(), units)
    return loss, metrics


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Sequence-level clipped surrogate (GSPO, Zheng et al. 2025), as in the paper.

    ``seq_ratio = exp(masked_mean_t(logp - old_logp))`` (length-normalised, hence the tiny
    default clip ranges). ``pg_loss1 = -A * seq_ratio``,
    ``pg_loss2 = -A * clamp(seq_ratio, 1 - clip_low, 1 + clip_high)``,
    ``loss = mean over all B sequences of max(pg_loss1, pg_loss2)``, a sequence without a
    valid token counting as 0 (TRL's ``importance_sampling_level="sequence"`` with
    ``loss_type="grpo"``). This is ``ppo_clip_loss(..., "seq-mean-token-mean",
    ratio_level="sequence")``, which also takes importance weights, a token penalty and the
    other aggregations.

    Args:
        logp: ``[B, T]`` log-probs of the current policy (carries the gradient).
        old_logp: ``[B, T]`` log-probs of the behaviour policy.
        advantages: ``[B]``, one per sequence.
        mask: ``[B, T]`` bool or 0/1.
        clip_low: lower clip range, in ``[0, 1)``.
        clip_high: upper clip range, ``>= 0``.

    Returns:
        ``(loss, metrics)`` as ``ppo_clip_loss`` at ``ratio_level="sequence"``: ``ratio_mean``
        (mean sequence ratio) and ``clip_fraction`` (fraction of sequences clipped), both over
        the sequences with a valid token, ``approx_kl`` (masked mean over tokens of the
        per-token k3 estimator) and ``pg_loss``.
    """
    return ppo_clip_loss(
        logp, old_logp, advantages, mask, clip_low, clip_high, "seq-mean-token-mean", ratio_level="sequence"
    )


def cispo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cap: float = 5.0,
    aggregation: LossAggregation = "token-mean",
    is_weights: Tensor | None = None,
    *,
    max_tokens: int | None = None,
    token_penalty: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): clip the importance weight, not the update; every token keeps a gradient.

    ``ratio = exp(safe_log_ratio(logp, old_logp))``; ``w = sg(min(ratio, cap))`` (stop-gradient
    on the truncated weight); ``pg_loss_tokens = -w * A * logp``, whose gradient is
    ``-w * A * grad(logp)``: a REINFORCE step weighted by the truncated ratio, so no token's
    gradient is dropped as PPO's clip drops it. Then ``x is_weights``, ``+ token_penalty`` and
    ``aggregate_loss`` as in ``ppo_clip_loss``. TRL ``loss_type="cispo"``:
    ``clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()``;
    ``per_token_loss = -clamped_ratios * advantages * per_token_logps`` (TRL's ``epsilon_high``
    is the cap itself there, ScaleRL's ``eps_max``, recommended 5.0; MiniMax-M1 writes it
    ``1 + eps_high^IS``). MiniMax-M1 sets no effective lower bound, nor does this.

    The loss *value* is ``-w A logp``, not a surrogate comparable with PPO's; only its gradient
    is meaningful.

    Args:
        logp: ``[B, T]`` log-probs of the current policy (carries the gradient).
        old_logp: ``[B, T]`` log-probs of the policy the advantages were computed for.
        advantages: ``[B]`` or ``[B, T]``.
        mask: ``[B, T]`` bool or 0/1.
        cap: the largest importance weight, ``> 0``.
        aggregation / is_weights / max_tokens / token_penalty: as in ``ppo_clip_loss``.

    Returns:
        ``(loss, metrics)``; metrics are detached scalars: ``pg_loss``, ``ratio_mean``,
        ``clip_fraction`` (masked fraction of tokens whose weight was truncated,
        ``ratio > cap``) and ``approx_kl``.
    """
    _check_per_token(logp, old_logp, mask)
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap!r}")
    _check_token_terms(logp, is_weights, token_penalty)
    advantages = _token_advantages(advantages, logp)
    valid = mask.bool()
    log_ratio = safe_log_ratio(logp, old_logp, valid)
    ratio = torch.exp(log_ratio)
    weights = torch.clamp(ratio, max=cap).detach()
    pg_loss_tokens = -weights * advantages * torch.where(valid, logp, 0.0)
    loss, pg_loss = _reduce(pg_loss_tokens, mask, aggregation, max_tokens, is_weights, token_penalty)

    with torch.no_grad():
        approx_kl = (ratio - 1) - log_ratio  # k3 estimator, Schulman 2020
        metrics = {
            "pg_loss": pg_loss,
            "ratio_mean": masked_mean(ratio, valid),
            "clip_fraction": masked_mean((ratio > cap).float(), valid),
            "approx_kl": masked_mean(approx_kl, valid),
        }
    return loss, metrics
