"""Fixtures for the vLLM engine tests (``make test-vllm``: a real vLLM, the CPU build, in .venv-vllm).

Every test module here starts with ``pytest.importorskip("vllm")``, so the main suite, whose venv has
no vLLM, skips them at collection. Nothing here imports vllm.
"""

from __future__ import annotations

import os

import pytest

# vLLM's engine core in the calling process: starts in ~2 s instead of ~18 s (set before ray starts,
# so Ray's workers inherit it); quiet vLLM's per-call INFO lines.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS = ["1+2=", "3*4=", "7=", "12-5="]


def tiny_policy(seed: int = 0):
    """The tiny Llama vLLM's CPU attention accepts (head size 32; 16 is not supported)."""
    from unirl_lightning.models import TinyCausalLM

    return TinyCausalLM(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, seed=seed)


def records(prompts=PROMPTS) -> list[dict[str, str]]:
    return [{"prompt": p} for p in prompts]


@pytest.fixture(scope="session")
def ray_local():
    import ray
    import torch

    torch.set_num_threads(1)
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 * 1024**2, log_to_driver=False)
    yield ray
    ray.shutdown()


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
    from unirl_lightning.rollout.types import RolloutRequest, SamplingParams

    request = RolloutRequest(
        records(), n=1, sampling=SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
    )
    return [group[0].completion_ids for group in engine.generate(request)]
