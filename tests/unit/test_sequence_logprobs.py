"""The trainer's log-probs skip the vocabulary projection of prompt positions without changing a value."""

from __future__ import annotations

import pytest
import torch

from tests.builders import tiny_module
from unirl_lightning.algorithms import token_logprobs
from unirl_lightning.models.lora import LoraSpec
from unirl_lightning.modules.tokens import accepts_logits_to_keep, first_response_column
from unirl_lightning.rollout.batches import ExperienceBatch
from unirl_lightning.rollout.records import Rollout


def batch_with_prompts_of(lengths: list[int], completion: int = 3) -> ExperienceBatch:
    g = torch.Generator().manual_seed(0)
    rows = [
        Rollout(
            prompt_ids=torch.randint(3, 17, (p,), generator=g).tolist(),
            completion_ids=torch.randint(3, 17, (completion,), generator=g).tolist(),
            logprobs=[-1.0] * completion,
            reward=float(i % 2),
            finish_reason="length",
        )
        for i, p in enumerate(lengths)
    ]
    return ExperienceBatch.collate([rows], pad_token_id=0)


def full_logprobs(module, batch: ExperienceBatch) -> torch.Tensor:
    logits = module.policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    return token_logprobs(logits, batch.input_ids[:, 1:], module.sampling.temperature)


def test_first_response_column_is_the_position_before_the_earliest_response_token():
    batch = batch_with_prompts_of([5, 3, 7, 4])
    # the shortest prompt has 3 tokens: its first response token is column 3, predicted at position 2
    assert first_response_column(batch.response_mask) == 2
    assert first_response_column(torch.zeros(2, 6, dtype=torch.long)) == 0


@pytest.mark.parametrize("lora", [None, LoraSpec(rank=4, alpha=8)], ids=["full", "lora"])
def test_logprobs_from_response_positions_only_equal_the_full_computation(lora):
    module = tiny_module(lora=lora, temperature=0.7)
    assert accepts_logits_to_keep(module.policy), (
        "a transformers Llama (PEFT-wrapped or not) takes logits_to_keep"
    )
    batch = batch_with_prompts_of([5, 3, 7, 4])
    mask = batch.response_mask[:, 1:].bool()
    with torch.no_grad():
        expected = full_logprobs(module, batch)
        logp, entropy = module.sequence_logprobs(module.policy, batch, entropy=True)
    assert logp.shape == expected.shape == entropy.shape
    torch.testing.assert_close(logp[mask], expected[mask], atol=1e-6, rtol=0)
    assert (logp[:, :2] == 0).all() and (entropy[:, :2] == 0).all(), (
        "columns before the first response read 0"
    )
    assert (entropy[mask] > 0).all()


def test_gradients_through_the_shortened_logits_equal_the_full_ones():
    module = tiny_module()
    batch = batch_with_prompts_of([6, 2, 4])
    mask = batch.response_mask[:, 1:].float()
    grads = []
    for compute in (
        lambda: full_logprobs(module, batch),
        lambda: module.sequence_logprobs(module.policy, batch),
    ):
        module.zero_grad()
        (compute() * mask).sum().backward()
        grads.append([p.grad.clone() for p in module.policy.parameters()])
    for full, short in zip(*grads):
        torch.testing.assert_close(short, full, atol=1e-6, rtol=1e-5)
