"""Advantage estimators: group-relative (GRPO, Dr.GRPO), leave-one-out (RLOO) and token-level GAE.

Contract: pure tensor functions, no gradient flows through any of them (advantages are
targets, not predictions). Group functions take rewards flat, ``[num_groups * group_size]``,
ordered group by group (the ``group_size`` samples of one prompt are contiguous), and return
advantages in the same order and shape. Bad arguments raise ``ValueError`` naming the
argument, the value seen and what is allowed.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

GroupNormalization = Literal["std", "mean"]
GROUP_NORMALIZATIONS: tuple[str, ...] = get_args(GroupNormalization)
GroupStd = Literal["unbiased", "population"]
GROUP_STDS: tuple[str, ...] = get_args(GroupStd)


def _grouped(rewards: Tensor, group_size: int, min_group_size: int) -> Tensor:
    """Check ``rewards``/``group_size`` and return rewards reshaped to ``[num_groups, group_size]``."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < min_group_size:
        raise ValueError(f"group_size must be an int >= {min_group_size}, got {group_size!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_groups * group_size], got shape {tuple(rewards.shape)}")
    if rewards.numel() == 0 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"len(rewards)={rewards.numel()} must be a positive multiple of group_size={group_size}"
        )
    rewards = rewards.detach()
    if not rewards.is_floating_point():
        rewards = rewards.float()
    return rewards.view(-1, group_size)


def group_advantages(
    rewards: Tensor,
    group_size: int,
    normalize: GroupNormalization = "std",
    eps: float = 1e-4,
    *,
    std: GroupStd = "unbiased",
) -> Tensor:
    """Group-relative advantages: each reward minus its group's mean, optionally over the group's std.

    ``normalize="std"``: ``(r - mean_g) / (std_g + eps)`` (GRPO, Shao et al. 2024).
    ``normalize="mean"``: ``r - mean_g`` (Dr.GRPO, Liu et al. 2025, which drops the std to
    remove the question-difficulty bias).

    ``std="unbiased"`` (default) is the sample std with Bessel's correction (divide by
    ``group_size - 1``), as TRL (``nanstd``, ``scale_rewards="group"``) and verl
    (``torch.std`` in ``compute_grpo_outcome_advantage``) compute it: a group ``[1, 0, 0, 1]``
    has std ``sqrt(1/3)`` and maps to ``±sqrt(3)/2``. ``std="population"`` divides by
    ``group_size`` (``np.std``, as flow_grpo's ``PerPromptStatTracker``): the same group maps
    to ``[1, -1, -1, 1]``.

    ``eps`` defaults to TRL's and flow_grpo's ``1e-4`` (verl: ``1e-6``). All-equal groups are
    zeroed exactly (below), so ``eps`` only acts on groups whose rewards differ by very little,
    where a larger ``eps`` bounds how much it can amplify reward noise (``|A| <= spread / eps``);
    for a group std ``>= 0.1`` the advantages differ from those with ``1e-6`` by under ``0.1 %``.

    A group whose rewards are all equal carries no learning signal and gets exactly 0 (also
    with ``group_size=1``), whatever rounding the mean would leave.

    Args:
        rewards: ``[num_groups * group_size]``, ordered group by group.
        group_size: samples per prompt, ``>= 1``.
        normalize: one of ``GROUP_NORMALIZATIONS``.
        eps: added to the std before dividing.
        std: one of ``GROUP_STDS``; used by ``normalize="std"`` only.

    Returns:
        ``[num_groups * group_size]`` advantages, float, detached.
    """
    if normalize not in GROUP_NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {GROUP_NORMALIZATIONS}, got {normalize!r}")
    if std not in GROUP_STDS:
        raise ValueError(f"std must be one of {GROUP_STDS}, got {std!r}")
    grouped = _grouped(rewards, group_size, min_group_size=1)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize == "std":
        # a group of one has no unbiased std (0 / 0); it is all-equal and zeroed below anyway
        correction = 1 if std == "unbiased" and group_size > 1 else 0
        advantages = advantages / (grouped.std(dim=1, correction=correction, keepdim=True) + eps)
    # all-equal groups: exactly 0, not rounding noise divided by eps
    all_equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    advantages = advantages.masked_fill(all_equal, 0.0)
    return advantages.reshape(-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE leave-one-out advantages (RLOO, Ahmadian et al. 2024).

    Each sample's baseline is the mean reward of the *other* ``group_size - 1`` samples of its
    group: ``A_i = r_i - (sum_g - r_i) / (group_size - 1)``, an unbiased baseline because it does
    not depend on the sample itself. Equals ``group_size / (group_size - 1) * (r_i - mean_g)``.

    Args:
        rewards: ``[num_groups * group_size]``, ordered group by group.
        group_size: samples per prompt, ``>= 2`` (one sample has nobody to leave out).

    Returns:
        ``[num_groups * group_size]`` advantages, float, detached.
    """
    grouped = _grouped(rewards, group_size, min_group_size=2)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - baseline).reshape(-1)


def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Token-level generalised advantage estimation (GAE, Schulman et al. 2016).

    Backwards over tokens: ``delta_t = r_t + gamma * V_next - V_t`` and
    ``A_t = delta_t + gamma * lam * A_next``, where ``V_next``/``A_next`` are those of the next
    *valid* (mask=1) token. Masked tokens are skipped: they take no part in the recursion
    (interior masked tokens, e.g. tool output in a multi-turn rollout, are jumped over), and
    after the last valid token of a sequence ``V_next = A_next = 0``, so nothing leaks across
    the end of a sequence from padding. Masked positions of both outputs are 0.

    Args:
        rewards: ``[B, T]`` per-token rewards (typically the score on the last valid token,
            minus any per-token KL penalty).
        values: ``[B, T]`` critic values; detached here.
        mask: ``[B, T]``, 1 (or True) on tokens that are trained on.
        gamma: discount, in ``[0, 1]``.
        lam: GAE lambda, in ``[0, 1]``.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``, detached; ``returns = advantages + values``
        (the critic's regression target). Advantages are not whitened.
    """
    if rewards.dim() != 2 or values.shape != rewards.shape or mask.shape != rewards.shape:
        raise ValueError(
            "rewards, values and mask must all be [B, T] with the same shape, got "
            f"rewards={tuple(rewards.shape)}, values={tuple(values.shape)}, mask={tuple(mask.shape)}"
        )
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam!r}")
    dtype = torch.promote_types(values.dtype, torch.float32)
    rewards = rewards.detach().to(dtype)
    values = values.detach().to(dtype)
    valid = mask.to(dtype)

    next_values = torch.zeros_like(values[:, 0])
    last_gae_lam = torch.zeros_like(values[:, 0])
    advantages_reversed = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        gae = delta + gamma * lam * last_gae_lam
        # a masked token leaves the carried V_next / A_next untouched
        next_values = torch.where(valid[:, t] > 0, values[:, t], next_values)
        last_gae_lam = torch.where(valid[:, t] > 0, gae, last_gae_lam)
        advantages_reversed.append(gae)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    advantages = torch.where(valid > 0, advantages, 0.0)
    returns = torch.where(valid > 0, returns, 0.0)
    return advantages, returns
