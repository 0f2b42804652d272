"""Stochastic sampling step with log-probabilities for flow-matching models (Flow-GRPO).

Contract: Flow-GRPO (Liu et al. 2025) turns the deterministic ODE sampler of a
rectified-flow model into an SDE with the same marginals, so that every denoising step is a
Gaussian policy ``p(x_{t-1} | x_t) = N(mean, std^2)`` whose log-probability can enter a PPO
ratio. Conventions: ``x_sigma = (1 - sigma) * x0 + sigma * noise`` (``sigma = 1`` is pure
noise, ``sigma = 0`` clean data) and the model predicts the velocity ``v = noise - x0``.

``sde_step`` is called twice per step by the diffusion trainer: once while sampling
(``prev_sample=None``) and once while training, replaying the stored ``prev_sample``. Both
calls compute ``log_prob`` with the same arithmetic, so with the same weights and inputs the
replayed log-prob equals the sampled one bit for bit (the on-policy ratio is exactly 1).
Store ``prev_sample`` as returned (float32): a lower-precision copy breaks that equality.

The KL to a reference model is ``flow_grpo_kl(mean, ref_mean, sde_std_dev_t(...))``, flow_grpo's
estimator (the exact Gaussian KL of the step times the step size; see its docstring).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def gaussian_log_prob(x: Tensor, mean: Tensor, std: Tensor | float) -> Tensor:
    """Element-wise log-density of ``x`` under ``N(mean, std^2)``.

    ``-(x - mean)^2 / (2 std^2) - log(std) - 0.5 log(2 pi)``.

    Args:
        x: any shape.
        mean: broadcastable to ``x``.
        std: ``> 0``, float or tensor broadcastable to ``x``.

    Returns:
        Element-wise log-density, the broadcast shape of the inputs.
    """
    std = torch.as_tensor(std, dtype=mean.dtype, device=mean.device)
    return -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - LOG_SQRT_2PI


def _as_column(name: str, value: Tensor | float, like: Tensor) -> Tensor:
    """A sigma as a tensor broadcastable to ``like`` ([B, ...]): a scalar, or [B] -> [B, 1, ..., 1]."""
    value = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if value.numel() == 1:
        return value.reshape(())
    if value.shape == like.shape[:1]:
        return value.view(-1, *([1] * (like.dim() - 1)))
    raise ValueError(
        f"{name} must be a float, a 1-element tensor or a [B] = {tuple(like.shape[:1])} tensor, "
        f"got shape {tuple(value.shape)}"
    )


def _std_dev_t(sigma: Tensor, sigma_next: Tensor, eta: float) -> Tensor:
    # sigma = 1 would divide by zero: use sigma_next there, as Flow-GRPO does
    sigma_for_std = torch.where(sigma >= 1, sigma_next, sigma)
    return eta * torch.sqrt(sigma / (1 - sigma_for_std))


def sde_std_dev_t(sample: Tensor, sigma: Tensor | float, sigma_next: Tensor | float, eta: float) -> Tensor:
    """Flow-GRPO's ``std_dev_t = eta * sqrt(sigma / (1 - sigma))`` of the step ``sigma -> sigma_next``.

    The same number ``sde_step`` uses (``sigma_next`` replaces ``sigma`` in ``1 - sigma`` at
    ``sigma = 1``) and the fourth output of flow_grpo's ``sde_step_with_logprob``; the step's
    transition std is ``std_dev_t * sqrt(sigma - sigma_next)``. Feed it to ``flow_grpo_kl``.

    Args:
        sample: ``[B, ...]`` the latents of the step; sets the dtype (float32 or float64),
            device and the broadcast shape.
        sigma / sigma_next / eta: as in ``sde_step``.

    Returns:
        A scalar, or ``[B, 1, ..., 1]`` for per-sample sigmas; broadcastable to ``sample``.
    """
    if not eta >= 0:
        raise ValueError(f"eta must be >= 0, got {eta!r}")
    like = sample.to(torch.promote_types(sample.dtype, torch.float32))
    return _std_dev_t(_as_column("sigma", sigma, like), _as_column("sigma_next", sigma_next, like), eta)


def flow_grpo_kl(mean: Tensor, ref_mean: Tensor, std_dev_t: Tensor | float) -> Tensor:
    """Flow-GRPO's per-step KL penalty: ``mean over non-batch dims of (mean - ref_mean)^2 / (2 std_dev_t^2)``.

    Exactly flow_grpo's ``scripts/train_sd3.py``: ``((prev_sample_mean - prev_sample_mean_ref)
    ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t ** 2)``, per row (flow_grpo then
    takes ``torch.mean`` over the batch, and over the steps through its loss average).

    Relation to the exact KL: policy and reference transitions are ``N(mean, s^2)`` and
    ``N(ref_mean, s^2)`` with the same ``s = std_dev_t * sqrt(-dt)``, ``dt = sigma_next -
    sigma < 0``, so per element ``KL = (mean - ref_mean)^2 / (2 s^2) = (mean - ref_mean)^2 /
    (2 std_dev_t^2 (-dt))``. Hence ``exact = flow_grpo_kl / (-dt)``, i.e. flow_grpo's penalty is
    the exact per-element KL times the step size ``sigma - sigma_next``: steps of different
    size are weighted differently, and ``beta`` is not comparable with a coefficient on the
    exact KL.

    Args:
        mean: ``[B, ...]`` policy mean of the step (``sde_step``'s third output; carries the
            gradient).
        ref_mean: ``[B, ...]`` reference mean of the same step.
        std_dev_t: ``sde_std_dev_t(...)`` of the step, ``> 0`` (``eta > 0``: at ``eta = 0``
            there is no noise and the KL is undefined); a float or broadcastable to ``mean``.

    Returns:
        ``[B]`` per-row KL penalty.
    """
    if ref_mean.shape != mean.shape or mean.dim() < 2:
        raise ValueError(
            f"mean and ref_mean must both be [B, ...] with the same shape, got mean={tuple(mean.shape)}, "
            f"ref_mean={tuple(ref_mean.shape)}"
        )
    if isinstance(std_dev_t, (int, float)) and not std_dev_t > 0:
        raise ValueError(f"std_dev_t must be > 0 (eta > 0), got {std_dev_t!r}")
    squared_diff = ((mean - ref_mean) ** 2).mean(dim=tuple(range(1, mean.dim())), keepdim=True)
    kl = squared_diff / (2 * torch.as_tensor(std_dev_t, dtype=squared_diff.dtype, device=mean.device) ** 2)
    return kl.reshape(mean.shape[0])


def sde_step(
    model_output: Tensor,
    sample: Tensor,
    sigma: Tensor | float,
    sigma_next: Tensor | float,
    eta: float,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One reverse step ``sigma -> sigma_next`` of the Flow-GRPO SDE, with its log-probability.

    With ``dt = sigma_next - sigma`` (negative) and ``std_dev_t = eta * sqrt(sigma / (1 - sigma))``
    (``sde_std_dev_t``)::

        mean = sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
               + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        std  = std_dev_t * sqrt(-dt)
        prev_sample = mean + std * noise            (only when prev_sample is None)
        log_prob = mean over non-batch dims of log N(prev_sample; mean, std^2)

    At ``sigma = 1`` the std formula divides by zero; there (and only there) ``sigma_next``
    replaces ``sigma`` in ``1 - sigma``, which is what Flow-GRPO does (``sigma_max = sigmas[1]``).
    ``eta = 0`` is the deterministic Euler step of the ODE, ``mean = sample + model_output * dt``,
    with ``std = 0``; then ``prev_sample = mean`` and ``log_prob`` is returned as zeros (a
    point mass has no finite density). The gradient flows through ``mean`` (to
    ``model_output``) only, never through ``prev_sample``. Everything is computed in float32
    (float64 stays float64).

    Args:
        model_output: ``[B, ...]`` predicted velocity ``v`` at ``sample``.
        sample: ``[B, ...]`` current latents ``x_sigma``.
        sigma: current noise level in ``(0, 1]``; a float, 1-element tensor or ``[B]``.
        sigma_next: next noise level in ``[0, sigma)``; same forms. Python floats are
            range-checked; tensors are trusted (checking them would sync the device).
        eta: noise level of the SDE (Flow-GRPO's ``noise_level``), ``>= 0``.
        prev_sample: ``[B, ...]`` the next latents to score instead of sampling them (replay
            during training); detached.
        generator: optional ``torch.Generator`` for the noise.

    Returns:
        ``(prev_sample, log_prob, mean, std)``: ``prev_sample`` and ``mean`` ``[B, ...]``,
        ``log_prob`` ``[B]``, ``std`` broadcastable to ``sample`` (a scalar or ``[B, 1, ..., 1]``).
    """
    if not eta >= 0:
        raise ValueError(f"eta must be >= 0, got {eta!r}")
    if sample.dim() < 2:
        raise ValueError(f"sample must be [B, ...] with at least 2 dims, got shape {tuple(sample.shape)}")
    if model_output.shape != sample.shape:
        raise ValueError(
            f"model_output must have the shape of sample {tuple(sample.shape)}, got {tuple(model_output.shape)}"
        )
    if prev_sample is not None and prev_sample.shape != sample.shape:
        raise ValueError(
            f"prev_sample must have the shape of sample {tuple(sample.shape)}, got {tuple(prev_sample.shape)}"
        )
    if isinstance(sigma, (int, float)) and not 0 < sigma <= 1:
        raise ValueError(f"sigma must be in (0, 1], got {sigma!r}")
    if (
        isinstance(sigma_next, (int, float))
        and isinstance(sigma, (int, float))
        and not 0 <= sigma_next < sigma
    ):
        raise ValueError(f"sigma_next must be in [0, sigma={sigma!r}), got {sigma_next!r}")

    dtype = torch.promote_types(sample.dtype, torch.float32)
    sample = sample.to(dtype)
    model_output = model_output.to(dtype)
    sigma = _as_column("sigma", sigma, sample)
    sigma_next = _as_column("sigma_next", sigma_next, sample)

    dt = sigma_next - sigma
    std_dev_t = _std_dev_t(sigma, sigma_next, eta)
    mean = (
        sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
        + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    std = std_dev_t * torch.sqrt(-dt)

    batch_size = sample.shape[0]
    if eta == 0:  # deterministic Euler step: a point mass, log_prob reported as 0
        prev_sample = mean.detach() if prev_sample is None else prev_sample.detach().to(dtype)
        return prev_sample, torch.zeros(batch_size, dtype=dtype, device=sample.device), mean, std

    if prev_sample is None:
        noise = torch.randn(sample.shape, generator=generator, dtype=dtype, device=sample.device)
        prev_sample = mean.detach() + std * noise
    prev_sample = prev_sample.detach().to(dtype)
    log_prob = gaussian_log_prob(prev_sample, mean, std)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.dim())))
    return prev_sample, log_prob, mean, std
