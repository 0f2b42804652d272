"""``generate_chunk`` on the real HF engine: a chunk stops at its token budget, and a row continued
after a weight change is scored by the new weights over prompt + partial (the prefix's KV cache is
recomputed, not kept from the old weights), with the prefix's tokens, log-probs and versions kept."""

from __future__ import annotations

import torch

from unirl_lightning.engines.base import generate_chunk
from unirl_lightning.engines.hf import HFEngine, HFEngineConfig
from unirl_lightning.models.causal_lm import TinyCausalLM
from unirl_lightning.rollout.records import PartialRow, RolloutRequest, SamplingParams

POLICY = TinyCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
RECORDS = [{"prompt": "3 4 5"}, {"prompt": "7"}]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=9)


def chunk(engine: HFEngine, partial: list[list[PartialRow]], tokens: int, seed: int) -> list[list]:
    request = RolloutRequest(
        RECORDS, n=2, sampling=SAMPLING, seed=seed, gen_id=5, chunk_tokens=tokens, partial=partial
    )
    return generate_chunk(engine, request)


def policy_logprobs(engine: HFEngine, prompt: list[int], completion: list[int]) -> list[float]:
    """The engine model's log-probs of ``completion`` after ``prompt``, from one full forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0].float()
    logps = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logps.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()


def test_a_row_continued_with_new_weights_is_scored_by_them_and_keeps_its_prefix():
    engine = HFEngine(HFEngineConfig(device="cpu", num_threads=None), POLICY, None)
    engine.stop_ids = []  # no early stop: every row runs into its budgets
    first = chunk(engine, [[PartialRow(0), PartialRow(1)], [PartialRow(0)]], tokens=4, seed=1)
    assert [len(group) for group in first] == [2, 1]
    for group in first:
        for rollout in group:
            assert len(rollout.completion_ids) == 4 and rollout.finish_reason == "aborted"
            assert rollout.token_versions == [0] * 4
    # new weights (version 1), then continue every row from prompt + partial
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in engine.model.state_dict().items()}
    engine.load_weights(state.items(), weight_version=1)
    partial = [
        [PartialRow(s, r.completion_ids, r.logprobs, r.token_versions) for s, r in enumerate(group)]
        for group in first
    ]
    second = chunk(engine, partial, tokens=4, seed=2)
    third = chunk(
        engine,
        [
            [PartialRow(s, r.completion_ids, r.logprobs, r.token_versions) for s, r in enumerate(g)]
            for g in second
        ],
        tokens=4,
        seed=3,
    )
    for before, after, done in zip(first, second, third):
        for old, new, last in zip(before, after, done):
            assert new.completion_ids[:4] == old.completion_ids and new.logprobs[:4] == old.logprobs
            assert new.token_versions == [0] * 4 + [1] * 4 and new.finish_reason == "aborted"
            # the whole budget (9) is spent in the third chunk: 1 token, then "length"
            assert len(last.completion_ids) == 9 and last.finish_reason == "length"
            assert last.token_versions == [0] * 4 + [1] * 5
            expected = policy_logprobs(engine, new.prompt_ids, last.completion_ids)[4:]
            assert torch.allclose(torch.tensor(last.logprobs[4:]), torch.tensor(expected), atol=1e-5)
            stale = policy_logprobs(engine, new.prompt_ids, last.completion_ids)[:4]
            assert not torch.allclose(torch.tensor(old.logprobs), torch.tensor(stale), atol=1e-3), (
                "the prefix's behaviour log-probs are those of the weights that generated it"
            )


class FiresAfter:
    """An interrupt signal that fires at its ``checks``-th read (the worker reads it before each chunk)."""

    def __init__(self, checks: int) -> None:
        self.checks, self.reads = checks, 0

    def fired(self, epoch: int) -> bool:
        self.reads += 1
        return self.reads > self.checks


def test_the_worker_goes_on_chunk_after_chunk_until_the_signal_fires():
    from unirl_lightning.engines.base import generate_chunks

    engine = HFEngine(HFEngineConfig(device="cpu", num_threads=None), POLICY, None)
    engine.stop_ids = []
    signal = FiresAfter(2)
    request = RolloutRequest(
        RECORDS,
        n=2,
        sampling=SAMPLING,
        seed=1,
        gen_id=5,
        chunk_tokens=3,
        partial=[[PartialRow(0), PartialRow(1)], [PartialRow(0)]],
        interrupt_signal=signal,
    )
    groups = generate_chunks(engine, request)
    assert signal.reads == 3  # before chunk 1, chunk 2, then fired
    assert [[len(r.completion_ids) for r in g] for g in groups] == [[6, 6], [6]]
    assert all(r.finish_reason == "aborted" and r.token_versions == [0] * 6 for g in groups for r in g)
    # without interruption the rows run to their whole budget (9 = 3 chunks) and finish
    request.interrupt_signal = FiresAfter(100)
    assert all(
        r.finish_reason == "length" and len(r.completion_ids) == 9
        for g in generate_chunks(engine, request)
        for r in g
    )
    # fired before the first chunk (a request queued behind another): nothing generated, nothing lost
    request.interrupt_signal = FiresAfter(0)
    assert all(
        r.completion_ids == [] and r.finish_reason == "aborted"
        for g in generate_chunks(engine, request)
        for r in g
    )
