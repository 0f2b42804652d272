"""Per-token log-probabilities and entropies from a causal LM's logits.

Contract: ``logits[:, t]`` is the distribution that produced ``tokens[:, t]`` (the caller has
already shifted by one). Both functions divide the logits by the sampling ``temperature``
first, so trainer log-probs match the behaviour log-probs that the rollout engine reports for
the same temperature. Results are float32 (float64 stays float64) whatever the logits' dtype.
Low-precision logits (bf16/fp16) are upcast one sequence at a time, so no float32 copy of the
whole ``[B, T, V]`` tensor is ever held. Gradients flow to ``logits``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check(logits: Tensor, temperature: float) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def _needs_row_loop(logits: Tensor) -> bool:
    return logits.dtype not in (torch.float32, torch.float64)


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """``log_softmax(logits / temperature)`` gathered at ``tokens``.

    Computed as ``logit[token] - logsumexp(logits)``, which never materialises the full
    log-softmax.

    Args:
        logits: ``[B, T, V]``, any float dtype.
        tokens: ``[B, T]`` integer token ids in ``[0, V)``.
        temperature: sampling temperature, ``> 0``.

    Returns:
        ``[B, T]`` log-probabilities, float32 (float64 if the logits are float64).
    """
    _check(logits, temperature)
    if tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"tokens must be [B, T] = {tuple(logits.shape[:2])} to match logits, got {tuple(tokens.shape)}"
        )
    index = tokens.long().unsqueeze(-1)
    if not _needs_row_loop(logits):
        scaled = logits / temperature
        return scaled.gather(-1, index).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    # bf16/fp16: upcast one sequence at a time (logsumexp in bf16 loses too much precision)
    rows = []
    for row_logits, row_index in zip(logits, index):
        scaled = row_logits.float() / temperature
        rows.append(scaled.gather(-1, row_index).squeeze(-1) - torch.logsumexp(scaled, dim=-1))
    return torch.stack(rows)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy ``H = -sum_v p_v log p_v`` of ``softmax(logits / temperature)`` at every position.

    Args:
        logits: ``[B, T, V]``, any float dtype.
        temperature: sampling temperature, ``> 0``.

    Returns:
        ``[B, T]`` entropies in nats, float32 (float64 if the logits are float64).
    """
    _check(logits, temperature)

    def entropy(scaled: Tensor) -> Tensor:
        log_probs = torch.log_softmax(scaled, dim=-1)
        return -(log_probs.exp() * log_probs).sum(dim=-1)

    if not _needs_row_loop(logits):
        return entropy(logits / temperature)
    return torch.stack([entropy(row_logits.float() / temperature) for row_logits in logits])
