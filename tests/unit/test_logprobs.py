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
