"""Per-token log-probabilities and entropies from a causal LM's logits, in bounded memory.

Contract: ``logits[:, t]`` is the distribution that produced ``tokens[:, t]`` (the caller has
already shifted by one). Both functions divide the logits by the sampling ``temperature``
first, so trainer log-probs match the behaviour log-probs that the rollout engine reports for
the same temperature. Results are float32 (float64 stays float64) whatever the logits' dtype,
and every reduction over the vocabulary runs in that precision (a logsumexp in bf16 loses too
much). Gradients flow to ``logits``.

Memory: the vocabulary is the largest axis of an LLM's activations (``[B, T, V]`` with V ~ 150k),
so neither function builds a float32 ``[B, T, V]`` tensor, in the forward or for the backward.
Both are :class:`torch.autograd.Function` s that walk the positions in chunks of about
``chunk_bytes`` of float32 work each (:data:`CHUNK_BYTES` by default): the float32 working set is
a few chunks, whatever B and T. For the backward they save only the ``logits`` themselves (the
tensor the model produced, in its own dtype: no copy) and one or two float32 numbers per position
(the logsumexp; for the entropy also the mean logit), and recompute the softmax chunk by chunk.
So the memory a training step adds beyond the model's own logits is ``O(B * T)`` plus one chunk,
where the plain ``log_softmax`` / ``logsumexp`` autograd graph keeps a float32 ``[B, T, V]`` copy
(two with a temperature) until the backward.

The values and gradients are those of the plain float32 (float64) computation
``log_softmax(logits.float() / temperature)``, up to float rounding; gradients are returned in
the logits' dtype, as autograd returns them through ``logits.float()``. Neither function is
twice differentiable.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

CHUNK_BYTES = 32 * 2**20
"""Default float32 work per chunk (bytes): ~55 positions of a 151936-token vocabulary, a whole
sequence of a small one."""

Block = tuple[slice, slice]


def _check(logits: Tensor, temperature: float) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision of the reductions and of the results: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _blocks(shape: torch.Size, work: torch.dtype, chunk_bytes: int) -> Iterator[Block]:
    """``(rows, positions)`` slices of ``[B, T]`` that tile it in chunks of about ``chunk_bytes`` of
    ``work``-dtype ``[., ., V]`` data: whole sequences, several at a time, when one fits, else
    runs of positions of one sequence. Every block indexes a view (no copy of the logits, even a
    non-contiguous slice of them)."""
    batch, length, vocab = shape
    per_block = max(1, chunk_bytes // max(1, vocab * torch.empty((), dtype=work).element_size()))
    if per_block >= length:
        rows = max(1, per_block // max(1, length))
        for b in range(0, batch, rows):
            yield slice(b, b + rows), slice(0, length)
        return
    for b in range(batch):
        for t in range(0, length, per_block):
            yield slice(b, b + 1), slice(t, t + per_block)


def _scaled(block: Tensor, work: torch.dtype, temperature: float) -> Tensor:
    """``block / temperature`` as a new ``work``-dtype tensor (one buffer: the division is in place)."""
    return block.to(work, copy=True).div_(temperature)


class _TokenLogprobs(torch.autograd.Function):
    """``z[token] - logsumexp(z)`` with ``z = logits / temperature`` in the work dtype, chunk by chunk;
    saves ``logits`` and the logsumexp, recomputes the softmax in the backward."""

    @staticmethod
    def forward(ctx, logits: Tensor, index: Tensor, temperature: float, chunk_bytes: int) -> Tensor:
        work = _work_dtype(logits.dtype)
        out = torch.empty(logits.shape[:2], dtype=work, device=logits.device)
        lse = torch.empty_like(out)
        with torch.autocast(logits.device.type, enabled=False):
            for rows, cols in _blocks(logits.shape, work, chunk_bytes):
                scaled = _scaled(logits[rows, cols], work, temperature)
                chunk_lse = torch.logsumexp(scaled, dim=-1)
                lse[rows, cols] = chunk_lse
                out[rows, cols] = scaled.gather(-1, index[rows, cols].unsqueeze(-1)).squeeze(-1) - chunk_lse
                del scaled
        ctx.save_for_backward(logits, index, lse)
        ctx.temperature, ctx.chunk_bytes = temperature, chunk_bytes
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, index, lse = ctx.saved_tensors
        temperature = ctx.temperature
        grad = torch.empty_like(logits)
        for rows, cols in _blocks(logits.shape, lse.dtype, ctx.chunk_bytes):
            g = grad_out[rows, cols].to(lse.dtype).unsqueeze(-1)
            # d(z[token] - lse(z)) / d logits = (onehot(token) - softmax(z)) / temperature
            chunk = (
                _scaled(logits[rows, cols], lse.dtype, temperature).sub_(lse[rows, cols].unsqueeze(-1)).exp_()
            )
            chunk.mul_(-g).scatter_add_(-1, index[rows, cols].unsqueeze(-1), g)
            grad[rows, cols] = chunk.div_(temperature)
            del chunk
        return grad, None, None, None


class _Entropy(torch.autograd.Function):
    """``H = lse(z) - sum_v p_v z_v`` chunk by chunk; saves ``logits``, the logsumexp and
    ``E_p[z]``; the backward is ``dH/dz_v = p_v (E_p[z] - z_v)``, recomputed per chunk."""

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, chunk_bytes: int) -> Tensor:
        work = _work_dtype(logits.dtype)
        lse = torch.empty(logits.shape[:2], dtype=work, device=logits.device)
        mean_z = torch.empty_like(lse)
        with torch.autocast(logits.device.type, enabled=False):
            for rows, cols in _blocks(logits.shape, work, chunk_bytes):
                scaled = _scaled(logits[rows, cols], work, temperature)
                chunk_lse = torch.logsumexp(scaled, dim=-1)
                lse[rows, cols] = chunk_lse
                # E_p[z] = sum_v exp(z_v - lse) z_v
                mean_z[rows, cols] = torch.linalg.vecdot(scaled.sub(chunk_lse.unsqueeze(-1)).exp_(), scaled)
                del scaled
        ctx.save_for_backward(logits, lse, mean_z)
        ctx.temperature, ctx.chunk_bytes = temperature, chunk_bytes
        return lse - mean_z

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, lse, mean_z = ctx.saved_tensors
        temperature = ctx.temperature
        grad = torch.empty_like(logits)
        for rows, cols in _blocks(logits.shape, lse.dtype, ctx.chunk_bytes):
            scaled = _scaled(logits[rows, cols], lse.dtype, temperature)
            probs = scaled.sub(lse[rows, cols].unsqueeze(-1)).exp_()
            # p_v (E_p[z] - z_v) / temperature, times the incoming gradient
            scale = grad_out[rows, cols].to(lse.dtype).unsqueeze(-1) / temperature
            grad[rows, cols] = probs.mul_(scaled.neg_().add_(mean_z[rows, cols].unsqueeze(-1))).mul_(scale)
            del scaled, probs
        return grad, None, None


def token_logprobs(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, *, chunk_bytes: int = CHUNK_BYTES
) -> Tensor:
    """``log_softmax(logits / temperature)`` gathered at ``tokens``, in bounded memory.

    Computed as ``z[token] - logsumexp(z)`` with ``z = logits / temperature`` upcast a chunk of
    positions at a time (see the module docstring): the full log-softmax is never materialised,
    and the backward keeps only ``logits`` and one logsumexp per position.

    Args:
        logits: ``[B, T, V]``, any float dtype (a non-contiguous slice is fine: it is not copied).
        tokens: ``[B, T]`` integer token ids in ``[0, V)``.
        temperature: sampling temperature, ``> 0``.
        chunk_bytes: float32 work per chunk.

    Returns:
        ``[B, T]`` log-probabilities, float32 (float64 if the logits are float64).
    """
    _check(logits, temperature)
    if tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"tokens must be [B, T] = {tuple(logits.shape[:2])} to match logits, got {tuple(tokens.shape)}"
        )
    return _TokenLogprobs.apply(logits, tokens.long(), float(temperature), int(chunk_bytes))


def entropy_from_logits(
    logits: Tensor, temperature: float = 1.0, *, chunk_bytes: int = CHUNK_BYTES
) -> Tensor:
    """Entropy ``H = -sum_v p_v log p_v`` of ``softmax(logits / temperature)`` at every position,
    in bounded memory (see the module docstring).

    Args:
        logits: ``[B, T, V]``, any float dtype.
        temperature: sampling temperature, ``> 0``.
        chunk_bytes: float32 work per chunk.

    Returns:
        ``[B, T]`` entropies in nats, float32 (float64 if the logits are float64).
    """
    _check(logits, temperature)
    return _Entropy.apply(logits, float(temperature), int(chunk_bytes))
