"""Per-token KL estimators between the policy and a reference policy (Schulman 2020).

Contract: given log-probs of the *sampled* tokens under the policy (``logp``) and under the
reference (``ref_logp``), return a per-token estimate of ``KL(policy || reference)``, same
shape as the inputs, differentiable in ``logp`` (use it as a loss term or, detached, as a
reward penalty). Reduction is the caller's: as a loss term, pass ``kl_coef * kl_penalty(...)``
to ``ppo_clip_loss(..., token_penalty=...)`` so it is aggregated with the policy loss.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)


def kl_penalty(
    logp: Tensor, ref_logp: Tensor, estimator: KLEstimator = "k3", mask: Tensor | None = None
) -> Tensor:
    """Per-token KL estimate from samples of the policy.

    With ``log_ratio = logp - ref_logp``:
        ``"k1"``: ``log_ratio`` (unbiased, high variance, can be negative);
        ``"k2"``: ``0.5 * log_ratio**2`` (biased, low variance, non-negative);
        ``"k3"``: ``exp(-log_ratio) + log_ratio - 1`` (unbiased, low variance, non-negative;
            the GRPO default, TRL's ``per_token_kl`` and verl's ``"low_var_kl"``/``"k3"``
            without verl's clamps to ``[-20, 20]`` and ``[-10, 10]``).

    Args:
        logp: ``[...]`` log-probs of the sampled tokens under the policy.
        ref_logp: same shape, under the reference policy.
        estimator: one of ``KL_ESTIMATORS``.
        mask: optional, same shape, bool or 0/1: the log ratio is zeroed where it is 0 before
            ``exp()``, so the estimate and its gradient are exactly 0 there even if the
            log-probs hold padding garbage (``inf``/``nan``).

    Returns:
        Per-token estimate, shape of ``logp``.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if ref_logp.shape != logp.shape:
        raise ValueError(
            f"ref_logp must have the shape of logp {tuple(logp.shape)}, got {tuple(ref_logp.shape)}"
        )
    if mask is not None and mask.shape != logp.shape:
        raise ValueError(f"mask must have the shape of logp {tuple(logp.shape)}, got {tuple(mask.shape)}")
    log_ratio = logp - ref_logp
    if mask is not None:
        log_ratio = torch.where(mask.bool(), log_ratio, 0.0)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    # k3 estimator, Schulman 2020: r - 1 - log r with r = ref/policy
    return torch.exp(-log_ratio) + log_ratio - 1
