"""Continuous batching on the HF engine: rows join and leave one running batch, and what a row samples,
and the log-probs it reports, are those of the same row generated alone."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from unirl_lightning.engines.batcher import BatchRow, ContinuousBatcher
from unirl_lightning.engines.hf import HFEngine, HFEngineConfig
from unirl_lightning.engines.hf_continuous import ContinuousHFEngine
from unirl_lightning.models.causal_lm import TinyCausalLM
from unirl_lightning.rollout.occupancy import OccupancyMeter
from unirl_lightning.rollout.records import RolloutRequest, SamplingParams

POLICY = TinyCausalLM(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=96
)
TEXTS = ["3+4=", "12+7=", "1=", "99+1=", "5+5+5=", "7"]


@pytest.fixture(scope="module")
def built():
    model, tok = POLICY.build()
    return model.eval(), tok


def batcher(built, max_rows: int, stage: bool = True, share_prompts: bool = True) -> ContinuousBatcher:
    model, tok = built
    return ContinuousBatcher(
        model,
        torch.device("cpu"),
        stop_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        max_rows=max_rows,
        max_positions=96,
        tokenizer=tok,
        stage=stage,
        share_prompts=share_prompts,
    )


def one_prompt(n: int, max_new_tokens: int) -> RolloutRequest:
    """``n`` samples of one prompt at temperature 1."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    return RolloutRequest(
        records=[{"prompt": "3+4=", "answer": "7"}], n=n, sampling=sampling, seed=0, gen_id=0
    )


def run(b: ContinuousBatcher, rows: list[BatchRow]) -> int:
    for row in rows:
        b.add(row)
    steps = 0
    while b.pending:
        b.step()
        steps += 1
    return steps


@pytest.mark.parametrize("stage", [True, False], ids=["staged", "joined"])
def test_greedy_rows_joining_at_different_times_match_generate_alone(built, stage):
    model, tok = built
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=12)
    rows = [BatchRow(p, sampling) for p in prompts]
    run(batcher(built, max_rows=2, stage=stage), rows)  # 2 slots: rows join as others leave, at other widths
    for prompt, row in zip(prompts, rows):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=12,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        alone = out[0, len(prompt) :].tolist()
        assert row.tokens == alone[: len(row.tokens)]
        assert row.finish_reason == ("stop" if row.tokens[-1] == tok.eos_token_id else "length")
        assert row.finish_reason == "stop" or len(row.tokens) == 12


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=16),
        SamplingParams(temperature=1.0, top_k=3, max_new_tokens=16),
    ],
    ids=["t0.7-top_p0.9", "t1-top_k3"],
)
def test_logprobs_are_those_of_the_raw_logits_at_the_temperature(built, sampling):
    model, tok = built
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    rows = [BatchRow(p, sampling, seed=i) for i, p in enumerate(prompts)]
    run(batcher(built, max_rows=3), rows)
    worst = 0.0
    for prompt, row in zip(prompts, rows):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + row.tokens])).logits[0].float()
        logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
        expected = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(row.tokens)]
        worst = max(worst, max(abs(a - b) for a, b in zip(expected, row.logprobs)))
        if sampling.top_k == 3:  # the sample comes from the processed distribution: a top-3 token
            for i, t in enumerate(row.tokens):
                assert t in logits[len(prompt) - 1 + i].topk(3).indices.tolist()
    assert worst < 1e-4


def test_a_seeded_row_samples_the_same_whatever_shares_its_batch(built):
    model, tok = built
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=20)
    first = [BatchRow(p, sampling, seed=10 + i) for i, p in enumerate(prompts)]
    second = [BatchRow(p, sampling, seed=10 + i) for i, p in enumerate(prompts)]
    run(batcher(built, max_rows=2), first)
    run(batcher(built, max_rows=6), list(reversed(second)))
    assert [r.tokens for r in first] == [r.tokens for r in second]
    assert len({tuple(r.tokens) for r in first}) > 1, "different seeds sample differently"


def test_staged_rows_refill_finished_slots_in_place_with_one_prefill_per_max_rows(built):
    """With the stage, waiting rows are prefilled ``max_rows`` at a time and take finished rows' slots
    in place (or join at the end when a prompt is wider than the running cache): the tokens and
    log-probs are those of the batcher that prefills every refill, with one prefill per 4 rows."""
    model, tok = built
    texts = ["1=", "7", "5+5+5=5+5+5=", "3+4=", "99+1=99+1=99", "2"] * 4  # wide prompts among narrow
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10)
    out = {}
    for stage in (True, False):
        b = batcher(built, max_rows=4, stage=stage)
        prefills = [0]
        prefill = b._prefill

        def counted(rows, prefill=prefill, prefills=prefills):
            prefills[0] += 1
            return prefill(rows)

        b._prefill = counted
        rows = [BatchRow(tok(t)["input_ids"], sampling, seed=i) for i, t in enumerate(texts)]
        run(b, rows)
        out[stage] = (rows, prefills[0])
    (staged, staged_prefills), (joined, joined_prefills) = out[True], out[False]
    assert [r.tokens for r in staged] == [r.tokens for r in joined]
    assert [r.finish_reason for r in staged] == [r.finish_reason for r in joined]
    worst = max(abs(a - b) for s, j in zip(staged, joined) for a, b in zip(s.logprobs, j.logprobs))
    assert worst < 1e-5
    assert staged_prefills == len(texts) // 4 < joined_prefills  # 6 against 11 when written


def test_a_groups_samples_staged_together_share_one_prefill_and_sample_as_if_prefilled_apart(built):
    """GRPO submits a prompt's samples together: staged together, they are prefilled once (a stage of 8
    rows = 2 groups of 4 = 2 prompts in the forward). Their tokens are those of every row prefilled
    on its own and of the unstaged batcher; log-probs agree to float rounding."""
    model, tok = built
    texts = [t for t in ("3+4=", "12+7=", "5+5+5=", "1=") for _ in range(4)]  # 4 groups of 4 samples
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    out = {}
    for name, stage, share in (("shared", True, True), ("apart", True, False), ("joined", False, False)):
        b = batcher(built, max_rows=8, stage=stage, share_prompts=share)
        prefilled = []
        prefill = b._prefill

        def counted(rows, prefill=prefill, prefilled=prefilled):
            prefilled.append(len(rows))
            return prefill(rows)

        b._prefill = counted
        rows = [BatchRow(tok(t)["input_ids"], sampling, seed=i) for i, t in enumerate(texts)]
        run(b, rows)
        out[name] = (rows, prefilled)
    shared, shared_prefilled = out["shared"]
    assert shared_prefilled == [2, 2] and out["apart"][1] == [8, 8]
    for other, _ in (out["apart"], out["joined"]):
        assert [r.tokens for r in shared] == [r.tokens for r in other]
        assert [r.finish_reason for r in shared] == [r.finish_reason for r in other]
        worst = max(abs(a - b) for s, o in zip(shared, other) for a, b in zip(s.logprobs, o.logprobs))
        assert worst < 1e-5
    assert len({tuple(r.tokens) for r in shared[:4]}) > 1, "a group's samples differ (their own seeds)"


def test_slots_stay_full_while_rows_wait_and_abort_keeps_the_tokens(built):
    model, tok = built
    sampling = SamplingParams(temperature=1.0, max_new_tokens=30)
    b = batcher(built, max_rows=3)
    rows = [BatchRow(tok("3+4=")["input_ids"], sampling, seed=i) for i in range(12)]
    for row in rows:
        b.add(row)
    full_steps = 0
    for _ in range(4):
        b.step()
        full_steps += len(b.active) == 3 or not b.waiting
    assert full_steps == 4, "a freed slot is refilled at the same step"
    ended = []
    for row in rows:
        row.on_finish = ended.append
    aborted = b.abort(lambda row: True)
    assert aborted == b.pending + aborted and b.pending == 0
    assert {r.finish_reason for r in ended} == {"aborted"}
    assert all(len(r.tokens) == len(r.logprobs) == len(r.versions) for r in rows)


def test_continuous_engine_serves_concurrent_requests_and_a_load_lands_between_steps():
    config = HFEngineConfig(device="cpu", num_threads=None, batching="continuous", max_batch_size=8)
    engine = config.build(POLICY)
    assert isinstance(engine, ContinuousHFEngine) and config.max_concurrency == 8
    static = HFEngineConfig(device="cpu", num_threads=None)
    assert static.max_concurrency == 1 and type(static.build(POLICY)) is HFEngine
    sampling = SamplingParams(temperature=1.0, max_new_tokens=40)
    requests = [
        RolloutRequest(
            records=[{"prompt": "3+4=", "answer": "7"}, {"prompt": "1+1=", "answer": "2"}],
            n=4,
            sampling=sampling,
            seed=i,
            gen_id=i,
        )
        for i in range(3)
    ]
    out: dict[int, list] = {}
    threads = [
        threading.Thread(target=lambda i=i: out.__setitem__(i, engine.generate(requests[i])))
        for i in range(3)
    ]
    for t in threads:
        t.start()
    named = [(n, p.clone() * 0.5) for n, p in engine.model.named_parameters()]
    engine.load_weights(named, weight_version=1)  # while they generate: between two decode steps
    for t in threads:
        t.join(timeout=60)
    assert sorted(out) == [0, 1, 2]
    for groups in out.values():
        assert [len(g) for g in groups] == [4, 4]
        for rollout in (r for g in groups for r in g):
            versions = rollout.versions()
            assert len(versions) == len(rollout.completion_ids) and versions == sorted(versions)
            assert set(versions) <= {0, 1}
    counters = engine.occupancy()
    assert counters["slots"] == 8 and 0 < counters["row_seconds"] <= 8 * counters["seconds"]
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate(requests[0])


def test_bad_config_names_the_key():
    with pytest.raises(ValueError, match="batching='dynamic' is invalid; expected 'static' or 'continuous'"):
        HFEngineConfig(batching="dynamic")
    with pytest.raises(ValueError, match="concurrent_calls=0 must be at least 1"):
        HFEngineConfig(concurrent_calls=0)


def test_occupancy_counts_the_tail_of_a_static_call_as_empty_slots():
    engine = HFEngine(HFEngineConfig(device="cpu", num_threads=None, max_batch_size=16), POLICY, None)
    meter = OccupancyMeter()
    first = engine.occupancy()
    meter.observe_spans([{"worker": 0, "occupancy": first}])
    groups = engine.generate(one_prompt(n=16, max_new_tokens=40))
    meter.observe_spans([{"worker": 0, "occupancy": engine.occupancy()}])
    lengths = [len(r.completion_ids) for r in groups[0]]
    stats = meter.stats()
    ratio = stats["rollout/engine_occupancy"]
    assert 0 < ratio <= sum(lengths) / (16 * max(lengths)) + 1e-9
    assert meter.stats() == {}, "a new window starts empty"
    # the call's tail is the engine's own waste, not starved: starved is only the time it ran no call
    assert 0 <= stats["rollout/engine_starved"] < 0.5
    time.sleep(0.2)
    meter.observe_spans([{"worker": 0, "occupancy": engine.occupancy()}])
    assert meter.stats()["rollout/engine_starved"] == pytest.approx(1.0), "no call ran: every slot starved"


def test_the_continuous_engine_reports_its_busy_share_and_mean_step_time():
    """The loop's own counters: the steps that produced a token and their seconds, so the meter gives
    the share of the window the loop stepped and the mean step time (a worker without them adds
    nothing to either)."""
    engine = HFEngineConfig(device="cpu", num_threads=None, batching="continuous", max_batch_size=4).build(
        POLICY
    )
    timed: list[float] = []
    step = engine.batcher.step

    def counted() -> int:
        start = time.perf_counter()
        produced = step()
        if produced:
            timed.append(time.perf_counter() - start)
        return produced

    engine.batcher.step = counted
    meter = OccupancyMeter()
    meter.observe_spans([{"worker": 0, "occupancy": engine.occupancy()}])
    meter.observe_spans([{"worker": 1, "occupancy": {"row_seconds": 0.0, "seconds": 0.0, "slots": 4.0}}])
    engine.generate(one_prompt(n=6, max_new_tokens=20))
    time.sleep(0.2)  # idle: counts against busy, not against the step time
    counters = engine.occupancy()
    assert counters["steps"] == len(timed) > 20 / 2, "every step that produced a token, once"
    assert counters["busy_seconds"] == pytest.approx(sum(timed), rel=0.05)
    meter.observe_spans([{"worker": 0, "occupancy": counters}])
    meter.observe_spans([{"worker": 1, "occupancy": {"row_seconds": 4.0, "seconds": 2.0, "slots": 4.0}}])
    stats = meter.stats()
    assert stats["rollout/engine_step_ms"] == pytest.approx(
        1e3 * counters["busy_seconds"] / counters["steps"]
    )
    # busy over worker 0's wall only (worker 1 reports no step counters)
    assert stats["rollout/engine_busy"] == pytest.approx(
        counters["busy_seconds"] / counters["seconds"], rel=0.05
    )
    assert 0 < stats["rollout/engine_busy"] < 1, "the 0.2 s idle is not busy"
    engine.close()


def starved_share(engine: ContinuousHFEngine, request: RolloutRequest) -> dict[str, float]:
    """The meter's figures over one ``generate`` of ``request`` (the window opens before the call)."""
    meter = OccupancyMeter()
    meter.observe_spans([{"worker": 0, "occupancy": engine.occupancy()}])
    engine.generate(request)
    meter.observe_spans([{"worker": 0, "occupancy": engine.occupancy()}])
    return meter.stats()


def test_starved_slots_are_the_free_ones_with_nothing_queued():
    """``rollout/engine_starved``: free slots while no row waits. Two rows in eight slots leave six
    starved at every step (and all eight before the rows arrive), so occupancy and starved fill the
    slot-time between them; sixteen rows in four slots keep rows queued until the tail."""
    config = HFEngineConfig(device="cpu", num_threads=None, batching="continuous", max_batch_size=8)
    engine = config.build(POLICY)
    time.sleep(0.05)  # the engine waits for work: every slot starved
    few = starved_share(engine, one_prompt(n=2, max_new_tokens=24))
    engine.close()
    assert few["rollout/engine_starved"] >= 6 / 8
    assert few["rollout/engine_occupancy"] + few["rollout/engine_starved"] == pytest.approx(1.0, abs=0.03)

    config = HFEngineConfig(device="cpu", num_threads=None, batching="continuous", max_batch_size=4)
    engine = config.build(POLICY)
    many = starved_share(engine, one_prompt(n=16, max_new_tokens=24))
    counters = engine.occupancy()
    engine.close()
    assert many["rollout/engine_starved"] < 0.5 < few["rollout/engine_starved"]
    assert many["rollout/engine_occupancy"] + many["rollout/engine_starved"] <= 1.0 + 1e-9
    assert 0 < counters["starved_slot_seconds"] <= counters["slots"] * counters["seconds"]


def test_the_meter_takes_starved_slots_only_from_engines_that_count_them():
    meter = OccupancyMeter()
    counted = {"row_seconds": 0.0, "seconds": 0.0, "slots": 4.0, "starved_slot_seconds": 0.0}
    meter.observe_spans([{"worker": 0, "occupancy": counted}])
    meter.observe_spans([{"worker": 1, "occupancy": {"row_seconds": 0.0, "seconds": 0.0, "slots": 4.0}}])
    counted = {"row_seconds": 4.0, "seconds": 2.0, "slots": 4.0, "starved_slot_seconds": 2.0}
    meter.observe_spans([{"worker": 0, "occupancy": counted}])
    meter.observe_spans([{"worker": 1, "occupancy": {"row_seconds": 8.0, "seconds": 2.0, "slots": 4.0}}])
    stats = meter.stats()
    assert stats["rollout/engine_occupancy"] == pytest.approx(12 / 16)
    assert stats["rollout/engine_starved"] == pytest.approx(2 / 8), "over worker 0's slot-time only"
    assert meter.stats() == {}


def test_a_row_counter_counts_every_free_slot_as_starved():
    from unirl_lightning.engines.streaming import RowCounter

    rows = RowCounter(slots=4)
    rows.add(3)
    time.sleep(0.02)
    counters = rows.occupancy()
    assert counters["row_seconds"] + counters["starved_slot_seconds"] == pytest.approx(
        4 * counters["seconds"]
    )
    assert counters["starved_slot_seconds"] >= counters["seconds"] - 1e-9, "at least one slot free all along"


def test_a_weight_load_waits_at_most_the_decode_step_in_progress():
    """The step lock is taken ahead of the decode loop: a load that arrives while rows decode lands after
    the step in progress at most (a plain lock let the loop take it again first, step after step, when
    the cores are busy)."""
    config = HFEngineConfig(device="cpu", num_threads=None, batching="continuous", max_batch_size=4)
    engine = config.build(POLICY)
    steps = [0]
    step = engine.batcher.step

    def counted() -> int:
        steps[0] += 1
        return step()

    engine.batcher.step = counted
    thread = threading.Thread(target=engine.generate, args=(one_prompt(n=160, max_new_tokens=60),))
    thread.start()
    while steps[0] < 3:
        threading.Event().wait(0.001)
    named = [(n, p.detach().clone()) for n, p in engine.model.named_parameters()]
    # Busy processes on every core, as a worker's trainer and Ray share them: a woken waiter is then
    # scheduled late, which is when a plain lock goes back to the loop step after step.
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    threading.Event().wait(0.1)  # they are spinning
    waited = []
    try:
        for version in range(1, 41):
            assert engine.batcher.pending  # rows are decoding: the load competes with the loop
            before = steps[0]
            engine.load_weights(named, weight_version=version)
            waited.append(steps[0] - before)
            threading.Event().wait(0.002)  # the loop decodes between two loads
    finally:
        for process in busy:
            process.kill()
            process.wait()
    thread.join(timeout=120)
    engine.close()
    # the loop starts at most the step it is about to start while a load takes its hold: ~0 in all
    # (a plain lock: 20-30 over the 40 loads, up to 5 for one)
    assert not thread.is_alive() and sum(waited) <= 2, waited
