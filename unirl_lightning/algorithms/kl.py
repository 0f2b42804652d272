"""Per-token KL estimators between the policy and a reference policy (Schulman 2020).

Contract: given log-probs of the *sampled* tokens under the policy (``logp``) and under the
reference (``ref_logp``), return a per-token estimate of ``KL(policy || reference)``, same
shape as the inputs, differentiable in ``logp`` (use it as a loss term or, detached, as a
reward penalty). Masking and reduction are the caller's (see ``losses.masked_mean``).
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL estimate from samples of the policy.

    With ``log_ratio = logp - ref_logp``:
        ``"k1"``: ``log_ratio`` (unbiased, high variance, can be negative);
        ``"k2"``: ``0.5 * log_ratio**2`` (biased, low variance, non-negative);
        ``"k3"``: ``exp(-log_ratio) + log_ratio - 1`` (unbiased, low variance, non-negative;
            the GRPO default).

    Args:
        logp: ``[...]`` log-probs of the sampled tokens under the policy.
        ref_logp: same shape, under the reference policy.
        estimator: one of ``KL_ESTIMATORS``.

    Returns:
        Per-token estimate, shape of ``logp``.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if ref_logp.shape != logp.shape:
        raise ValueError(
            f"ref_logp must have the shape of logp {tuple(logp.shape)}, got {tuple(ref_logp.shape)}"
        )
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    # k3 estimator, Schulman 2020: r - 1 - log r with r = ref/policy
    return torch.exp(-log_ratio) + log_ratio - 1
