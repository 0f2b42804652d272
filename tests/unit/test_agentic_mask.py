"""Only model tokens are trained: a multi-turn sample's environment tokens are masked out of the loss
(``Rollout.loss_mask`` -> ``ExperienceBatch.response_mask``), so their behaviour log-probs never touch
the loss or the gradients."""

from __future__ import annotations

import pytest
import torch

from tests.builders import tiny_module
from unirl_lightning.rollout.batches import ExperienceBatch
from unirl_lightning.rollout.records import AgenticRollout, Rollout

PROMPT = [18]  # "?"
# model turn (2 tokens), observation (1), model turn (2), observation (1), model turn (1)
COMPLETION = [8, 2, 20, 9, 2, 14, 5]
MASK = [1, 1, 0, 1, 1, 0, 1]


def episode(reward: float, shift: int = 0) -> AgenticRollout:
    ids = [(t + shift) % 20 + 3 if m else t for t, m in zip(COMPLETION, MASK)]
    logprobs = [-1.0 - 0.1 * i if m else 0.0 for i, m in enumerate(MASK)]
    return AgenticRollout(PROMPT, ids, logprobs, reward, "stop", loss_mask=list(MASK), num_turns=3)


def batch_of() -> ExperienceBatch:
    group = [episode(1.0), episode(0.0, shift=1), episode(0.5, shift=2), episode(0.0, shift=3)]
    return ExperienceBatch.collate([group], pad_token_id=0)


def loss_and_grads(module, batch: ExperienceBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    module.policy.zero_grad()
    context = module.prepare_batch(batch)
    loss, _ = module.policy_loss(batch, context)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in module.policy.parameters() if p.grad is not None]


def test_collate_masks_environment_tokens_and_keeps_every_token_as_context():
    batch = batch_of()
    row = 1 + len(COMPLETION)
    assert batch.response_mask[0, :row].tolist() == [0.0] + [float(m) for m in MASK]
    assert batch.attention_mask[0, :row].tolist() == [1] * row  # environment tokens stay in the context
    env_positions = [1 + i for i, m in enumerate(MASK) if not m]
    assert batch.rollout_logprobs[:, env_positions].abs().sum() == 0


def test_a_rollout_without_loss_mask_trains_every_completion_token():
    single = Rollout([18], [5, 2], [-1.0, -2.0], 1.0, "stop")
    batch = ExperienceBatch.collate([[single]], pad_token_id=0)
    assert batch.response_mask[0].tolist() == [0.0, 1.0, 1.0]


def test_a_loss_mask_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="loss_mask needs one entry per completion token: 2 tokens, 1"):
        Rollout([18], [5, 2], [-1.0, -2.0], 1.0, "stop", loss_mask=[1])


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {
            "old_logprob": "recompute",
            "tis_cap": 2.0,
            "kl_coef": 0.1,
            "loss_aggregation": "seq-mean-token-mean",
        },
    ],
    ids=["rollout-logprobs", "recompute-tis-kl"],
)
def test_perturbing_an_environment_tokens_logprob_changes_neither_loss_nor_gradients(settings):
    torch.manual_seed(0)
    module = tiny_module(**settings)
    module.setup("fit")
    batch = batch_of()
    loss, grads = loss_and_grads(module, batch)
    env_position = 1 + MASK.index(0)
    perturbed = batch_of()
    perturbed.rollout_logprobs[:, env_position] += 5.0
    loss_env, grads_env = loss_and_grads(module, perturbed)
    assert torch.equal(loss, loss_env)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_env))
    # the same perturbation on a model token does change the loss: the check can see a difference
    model_position = 1 + MASK.index(1, 3)
    on_model = batch_of()
    on_model.rollout_logprobs[:, model_position] += 0.5
    loss_model, _ = loss_and_grads(module, on_model)
    assert not torch.equal(loss, loss_model)
