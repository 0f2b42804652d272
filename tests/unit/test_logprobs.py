"""Pins unirl_lightning.algorithms.logprobs against hand-computed numbers."""

import math

import pytest
import torch

from unirl_lightning.algorithms.logprobs import entropy_from_logits, token_logprobs

# one position, vocabulary of 2 with probabilities [1/4, 3/4]
LOGITS_QUARTER = torch.tensor([[[0.0, math.log(3.0)]]])


def test_token_logprobs_is_log_softmax_at_the_token():
    tokens = torch.tensor([[1]])
    assert torch.allclose(token_logprobs(LOGITS_QUARTER, tokens), torch.tensor([[math.log(0.75)]]))
    assert torch.allclose(
        token_logprobs(LOGITS_QUARTER, torch.tensor([[0]])), torch.tensor([[math.log(0.25)]])
    )


def test_token_logprobs_divides_logits_by_temperature():
    # [0, 2 log 3] / 2 = [0, log 3] -> probabilities [1/4, 3/4]
    logits = torch.tensor([[[0.0, 2 * math.log(3.0)]]])
    out = token_logprobs(logits, torch.tensor([[1]]), temperature=2.0)
    assert torch.allclose(out, torch.tensor([[math.log(0.75)]]))


def test_token_logprobs_of_bf16_logits_are_float32_and_match_the_float32_result():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.5, 0.5, 0.0]], [[0.0, 0.0, 0.0], [4.0, -4.0, 0.0]]])
    tokens = torch.tensor([[2, 0], [1, 1]])
    out = token_logprobs(logits.bfloat16(), tokens)
    assert out.dtype == torch.float32
    # these logits are exact in bf16, so the upcast result equals the float32 one
    assert torch.allclose(out, token_logprobs(logits, tokens))
    assert torch.allclose(out[1, 0], torch.tensor(-math.log(3.0)))


def test_token_logprobs_gradient_flows_to_logits():
    logits = LOGITS_QUARTER.clone().requires_grad_(True)
    token_logprobs(logits, torch.tensor([[1]])).sum().backward()
    # d log p_1 / d z = onehot(1) - p = [-1/4, 1/4]
    assert torch.allclose(logits.grad, torch.tensor([[[-0.25, 0.25]]]))


def test_token_logprobs_rejects_bad_temperature_and_shapes():
    with pytest.raises(ValueError, match=r"temperature must be > 0, got 0.0"):
        token_logprobs(LOGITS_QUARTER, torch.tensor([[1]]), temperature=0.0)
    with pytest.raises(ValueError, match=r"tokens must be \[B, T\] = \(1, 1\) to match logits, got \(1, 2\)"):
        token_logprobs(LOGITS_QUARTER, torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match=r"logits must be \[B, T, V\], got shape \(1, 2\)"):
        token_logprobs(torch.zeros(1, 2), torch.tensor([[1]]))


def test_entropy_of_uniform_is_log_vocab_size():
    assert torch.allclose(entropy_from_logits(torch.zeros(1, 2, 4)), torch.full((1, 2), math.log(4.0)))


def test_entropy_of_quarter_three_quarters_and_with_temperature():
    # H = -(1/4 log 1/4 + 3/4 log 3/4) = 0.562335
    expected = torch.tensor([[0.5623351446]])
    assert torch.allclose(entropy_from_logits(LOGITS_QUARTER), expected)
    assert torch.allclose(entropy_from_logits(LOGITS_QUARTER * 2, temperature=2.0), expected)
    assert torch.allclose(entropy_from_logits(LOGITS_QUARTER.bfloat16()), expected, atol=1e-3)


def test_entropy_rejects_negative_temperature():
    with pytest.raises(ValueError, match=r"temperature must be > 0, got -1.0"):
        entropy_from_logits(LOGITS_QUARTER, temperature=-1.0)


# -- the chunked computation equals the plain one, in values, gradients and memory ------------------
def plain_token_logprobs(logits, tokens, temperature):
    """The straightforward float32 (float64) computation the chunked one must equal."""
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scaled = logits.to(work) / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def plain_entropy(logits, temperature):
    work = torch.float64 if logits.dtype == torch.float64 else torch.float32
    log_probs = torch.log_softmax(logits.to(work) / temperature, dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def random_logits(dtype, shape=(3, 7, 13), seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)


# chunk_bytes=1: one position per chunk; 3 * 13 * 4: three positions (runs inside a row); huge: all rows
CHUNKS = [1, 3 * 13 * 4, 2 * 7 * 13 * 4, 2**40]
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-5}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk_bytes", CHUNKS)
def test_chunked_logprobs_and_entropy_equal_the_plain_computation_with_their_gradients(dtype, chunk_bytes):
    temperature = 0.7
    logits = random_logits(dtype).requires_grad_(True)
    tokens = torch.randint(0, 13, (3, 7), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(3, 7, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    atol = TOLERANCE[dtype]
    for chunked, plain in (
        (
            lambda x: token_logprobs(x, tokens, temperature, chunk_bytes=chunk_bytes),
            lambda x: plain_token_logprobs(x, tokens, temperature),
        ),
        (
            lambda x: entropy_from_logits(x, temperature, chunk_bytes=chunk_bytes),
            lambda x: plain_entropy(x, temperature),
        ),
    ):
        out, expected = chunked(logits), plain(logits)
        assert out.dtype == expected.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        torch.testing.assert_close(out, expected, atol=atol, rtol=0)
        (grad,) = torch.autograd.grad((out * weights.to(out.dtype)).sum(), logits)
        (expected_grad,) = torch.autograd.grad((expected * weights.to(out.dtype)).sum(), logits)
        assert grad.dtype == dtype, "the gradient comes back in the logits' dtype, as through logits.float()"
        # bf16: both are the same float32 gradient rounded to bf16 (equal but for a rare last-bit tie)
        torch.testing.assert_close(
            grad, expected_grad, atol=atol if dtype != torch.bfloat16 else 1e-2, rtol=0
        )


def test_chunked_logprobs_and_entropy_pass_gradcheck_in_float64():
    logits = random_logits(torch.float64, shape=(2, 3, 5)).requires_grad_(True)
    tokens = torch.tensor([[0, 4, 2], [1, 1, 3]])
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs(x, tokens, 1.3, chunk_bytes=2 * 5 * 8), (logits,)
    )
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, 0.6, chunk_bytes=1), (logits,))


def test_a_non_contiguous_slice_of_the_logits_is_read_in_place():
    full = random_logits(torch.bfloat16, shape=(2, 6, 13))
    logits = full[:, 2:][:, :-1]  # what sequence_logprobs passes: not viewable as [B*T, V]
    tokens = torch.randint(0, 13, (2, 3))
    torch.testing.assert_close(
        token_logprobs(logits, tokens, chunk_bytes=1),
        plain_token_logprobs(logits, tokens, 1.0),
        atol=1e-5,
        rtol=0,
    )


def extra_saved_bytes(compute, logits) -> int:
    """Bytes of the storages autograd keeps for the backward of ``compute()`` besides the storage of
    ``logits`` itself (which the model holds anyway), counting each storage once."""
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = compute()
    assert out.requires_grad
    own = logits.untyped_storage().data_ptr()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(size for ptr, size in storages.items() if ptr != own)


def old_row_loop_token_logprobs(logits, tokens, temperature):
    """The implementation this one replaced: one float32 copy per sequence, each kept for the backward."""
    rows = []
    for row_logits, row_index in zip(logits, tokens.unsqueeze(-1)):
        scaled = row_logits.float() / temperature
        rows.append(scaled.gather(-1, row_index).squeeze(-1) - torch.logsumexp(scaled, dim=-1))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_backward_keeps_the_logits_and_per_position_numbers_only(dtype):
    batch, length, vocab = 4, 16, 4096
    logits = random_logits(dtype, shape=(batch, length, vocab)).requires_grad_(True)
    tokens = torch.randint(0, vocab, (batch, length))
    float32_copy = batch * length * vocab * 4  # what one float32 [B, T, V] tensor costs
    per_position = batch * length * (8 + 4 + 4)  # int64 token ids, a float32 logsumexp, slack for a mean

    assert extra_saved_bytes(lambda: token_logprobs(logits, tokens, 0.7), logits) <= per_position
    assert extra_saved_bytes(lambda: entropy_from_logits(logits, 0.7), logits) <= per_position
    # what it replaced keeps a float32 [B, T, V] copy until the backward: the bf16 row loop one per
    # sequence, the plain float32 graph its log-softmax
    old = old_row_loop_token_logprobs if dtype == torch.bfloat16 else plain_token_logprobs
    assert extra_saved_bytes(lambda: old(logits, tokens, 0.7), logits) >= float32_copy
