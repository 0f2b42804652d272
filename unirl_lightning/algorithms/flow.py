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

    With ``dt = sigma_next - sigma`` (negative) and ``std_dev_t = eta * sqrt(sigma / (1 - sigma))``::

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
    # sigma = 1 would divide by zero: use sigma_next there, as Flow-GRPO does
    sigma_for_std = torch.where(sigma >= 1, sigma_next, sigma)
    std_dev_t = eta * torch.sqrt(sigma / (1 - sigma_for_std))
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
