"""Helpers of the vLLM engine tests: the tiny policy vLLM's CPU attention accepts, prompts, and the
trainer-side recompute the engine's log-probs are compared with."""

from __future__ import annotations

PROMPTS = ["1+2=", "3*4=", "7=", "12-5="]


def tiny_policy(seed: int = 0):
    """The tiny Llama vLLM's CPU attention accepts (head size 32; 16 is not supported)."""
    from unirl_lightning.models.causal_lm import TinyCausalLM

    return TinyCausalLM(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, seed=seed)


def records(prompts=PROMPTS) -> list[dict[str, str]]:
    return [{"prompt": p} for p in prompts]


def hf_recompute(model, rollout, temperature: float):
    """What the trainer computes: log-probs of the completion tokens, teacher-forced, at ``temperature``."""
    import torch

    from unirl_lightning.algorithms import token_logprobs

    ids = torch.tensor([rollout.prompt_ids + rollout.completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
    return token_logprobs(logits, ids[:, 1:], temperature)[0, len(rollout.prompt_ids) - 1 :]


def max_logprob_gap(model, groups, temperature: float) -> float:
    """Largest |engine log-prob - trainer recompute| over every sampled token of ``groups``."""
    import torch

    return max(
        float((hf_recompute(model, r, temperature) - torch.tensor(r.logprobs)).abs().max())
        for group in groups
        for r in group
    )


def greedy_completions(engine, max_new_tokens: int = 12) -> list[list[int]]:
    from unirl_lightning.rollout.records import RolloutRequest, SamplingParams

    request = RolloutRequest(
        records(), n=1, sampling=SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
    )
    return [group[0].completion_ids for group in engine.generate(request)]
