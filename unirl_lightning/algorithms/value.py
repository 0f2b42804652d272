"""Value-function pieces of actor-critic PPO: reward placement, whitening, clipped value loss, EV.

Contract: ``[B, T]`` per-token tensors with a ``mask`` (1 on completion tokens); masked positions
never reach a result.
"""

from __future__ import annotations

import torch

from unirl_lightning.algorithms.losses import LossAggregation, aggregate_loss, masked_mean


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` per-token rewards: each sequence's score on its last valid token, 0 elsewhere."""
    last = mask.shape[1] - 1 - mask.flip(-1).float().argmax(dim=-1)  # index of the last 1 in each row
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    token_rewards[torch.arange(mask.shape[0], device=mask.device), last] = rewards.float()
    return token_rewards


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / std`` over the valid tokens of the whole batch; masked positions are 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return torch.where(mask.bool(), (x - mean) * torch.rsqrt(var + eps), 0.0)


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float | None,
    aggregation: LossAggregation,
    max_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``0.5 * max((V - R)^2, (V_clipped - R)^2)`` with ``V_clipped = V_old + clamp(V - V_old, +-value_clip)``
    (PPO2, as in CleanRL); unclipped when ``value_clip`` is None. Reduced with
    ``aggregate_loss(..., aggregation, max_tokens)``. Returns ``(loss, vf_clip_fraction)``."""
    v_loss_unclipped = (values - returns) ** 2
    if value_clip is None:
        no_clip = torch.zeros((), device=values.device)
        return 0.5 * aggregate_loss(v_loss_unclipped, mask, aggregation, max_tokens), no_clip
    v_clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    v_loss_clipped = (v_clipped - returns) ** 2
    loss = 0.5 * aggregate_loss(torch.max(v_loss_unclipped, v_loss_clipped), mask, aggregation, max_tokens)
    return loss, masked_mean((v_loss_clipped > v_loss_unclipped).float().detach(), mask)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var(R - V) / Var(R)`` over valid tokens: 1 = perfect critic, 0 = no better than a constant;
    NaN when the returns do not vary (CleanRL)."""

    def var(x: torch.Tensor) -> torch.Tensor:
        return masked_mean((x - masked_mean(x, mask)) ** 2, mask)

    var_returns = var(returns)
    if var_returns == 0:
        return torch.full((), float("nan"), device=returns.device)
    return 1 - var(returns - values) / var_returns
