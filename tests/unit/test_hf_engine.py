"""The HF engine scores each sampled token as it generates, with the log-probs keeping every logit gave."""

from __future__ import annotations

import pytest
import torch

from unirl_lightning.core.seeding import derive_seed
from unirl_lightning.engines.hf import HFEngine, HFEngineConfig, StepScorer
from unirl_lightning.models.causal_lm import TinyCausalLM
from unirl_lightning.models.lora import LoraSpec, unwrapped
from unirl_lightning.rollout.records import SamplingParams

POLICY = TinyCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11, 12]]


def kept_logits_logprobs(engine: HFEngine, prompts, sampling: SamplingParams, seed: int):
    """What the engine computed before: keep every step's raw logits (``output_logits``), stack them
    and take ``log_softmax(logits.float() / T)`` at the sampled tokens (T = 1 when greedy)."""
    tok = engine.tokenizer
    width = max(len(ids) for ids in prompts)
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(ids)) + ids for ids in prompts])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    greedy = sampling.temperature == 0
    kwargs = dict(
        max_new_tokens=sampling.max_new_tokens,
        do_sample=not greedy,
        pad_token_id=tok.pad_token_id,
        eos_token_id=engine.stop_ids,
        output_logits=True,
        return_dict_in_generate=True,
    )
    if not greedy:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = engine.model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    new_tokens = out.sequences[:, width:]
    logits = torch.stack(out.logits, dim=1).float() / (1.0 if greedy else sampling.temperature)
    logps = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
    return new_tokens, logps


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=6),
        SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=5),
        SamplingParams(temperature=0.0, max_new_tokens=4),
    ],
    ids=["t0.7-top_p0.9", "t1", "greedy"],
)
@pytest.mark.parametrize("lora", [None, LoraSpec(rank=4)], ids=["full", "lora"])
def test_streamed_logprobs_equal_those_of_the_kept_logits(sampling, lora):
    engine = HFEngine(HFEngineConfig(device="cpu", num_threads=None), POLICY, lora)
    tokens, expected = kept_logits_logprobs(engine, PROMPTS, sampling, seed=derive_seed(3, 0))
    samples = engine.generate_ids(PROMPTS, sampling, seed=3)
    for row, (completion, logprobs, _finish) in enumerate(samples):
        assert completion == tokens[row, : len(completion)].tolist(), "the same seed samples the same tokens"
        torch.testing.assert_close(
            torch.tensor(logprobs), expected[row, : len(completion)], atol=1e-6, rtol=0
        )
        assert all(lp <= 0 for lp in logprobs)


def test_rows_that_stop_early_keep_the_logprobs_of_their_own_tokens():
    engine = HFEngine(HFEngineConfig(device="cpu", num_threads=None), POLICY, None)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    tokens, _ = kept_logits_logprobs(engine, PROMPTS, sampling, seed=derive_seed(0, 0))
    engine.stop_ids = [int(tokens[0, 1])]  # a token row 0 samples second: it stops there
    tokens, expected = kept_logits_logprobs(engine, PROMPTS, sampling, seed=derive_seed(0, 0))
    samples = engine.generate_ids(PROMPTS, sampling, seed=0)
    assert samples[0][2] == "stop" and len(samples[0][0]) == 2
    for row, (completion, logprobs, _) in enumerate(samples):
        torch.testing.assert_close(
            torch.tensor(logprobs), expected[row, : len(completion)], atol=1e-6, rtol=0
        )


def test_the_scorer_refuses_tokens_it_did_not_see_sampled():
    scorer = StepScorer(temperature=1.0)
    scorer._row = torch.log_softmax(torch.zeros(2, 5), dim=-1)
    scorer._score(torch.tensor([1, 2]))  # what the next forward's input said was sampled
    with pytest.raises(RuntimeError, match="not the ones it returned"):
        scorer.logprobs(torch.tensor([[1], [3]]))
    assert scorer.logprobs(torch.tensor([[1], [2]])).shape == (2, 1)


GROUPED = [ids for ids in PROMPTS for _ in range(4)]  # a request's rows: each prompt n = 4 times


@pytest.mark.parametrize("lora", [None, LoraSpec(rank=4)], ids=["full", "lora"])
def test_rows_of_one_prompt_share_its_prefill_and_sample_as_the_plain_path(lora):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    engine = HFEngine(HFEngineConfig(device="cpu", num_threads=None), POLICY, lora)
    batch_sizes: list[tuple[int, int]] = []  # (rows, tokens) of every forward of the model
    first_layer = unwrapped(engine.model).model.layers[0]  # runs in every forward, LoRA or not

    def record(module, args, kwargs):  # noqa: ANN001, ANN202
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        batch_sizes.append(tuple(hidden.shape[:2]))

    handle = first_layer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        shared = engine.generate_ids(GROUPED, sampling, seed=5)
    finally:
        handle.remove()
    # one prefill of the 3 distinct prompts, all but their last token (width 5 - 1), then generate
    # starts from the last prompt token of all 12 rows
    assert batch_sizes[0] == (3, 4) and batch_sizes[1] == (12, 1)
    engine.config = HFEngineConfig(device="cpu", num_threads=None, share_prompt_prefill=False)
    plain = engine.generate_ids(GROUPED, sampling, seed=5)
    for (c1, lp1, f1), (c2, lp2, f2) in zip(shared, plain):
        assert c1 == c2 and f1 == f2
        torch.testing.assert_close(torch.tensor(lp1), torch.tensor(lp2), atol=1e-5, rtol=0)
    # and the log-probs are those of the model on the whole sequence (the trainer's recompute)
    for ids, (completion, logprobs, _) in zip(GROUPED, shared):
        seq = torch.tensor([ids + completion])
        with torch.no_grad():
            logits = engine.model(input_ids=seq).logits[0, len(ids) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=0)


def test_no_repeated_prompt_or_a_one_token_prompt_prefills_every_row():
    engine = HFEngine(HFEngineConfig(device="cpu", num_threads=None), POLICY, None)
    rows = [[3, 4, 5], [6, 7]]
    assert engine._shared_prefill(rows, *padded(engine, rows)) is None  # noqa: SLF001
    rows = [[3], [3], [6, 7]]
    assert engine._shared_prefill(rows, *padded(engine, rows)) is None  # noqa: SLF001


def padded(engine: HFEngine, prompts):
    width = max(len(ids) for ids in prompts)
    pad = engine.tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask
