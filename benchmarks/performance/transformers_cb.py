"""The HF engine's continuous batcher against transformers' own continuous batching
(``model.init_continuous_batching``, a started ``ContinuousBatchingManager``): speed, and the three
contracts an RL engine needs (behaviour log-probs, seeded rows, a weight load in flight).

    python -m benchmarks.performance.transformers_cb [--slots 16 128] [--rows 512] [--rounds 3]

Speed. The long-tail workload's model (the tiny random Llama, hidden 64, 2 layers, one torch thread):
``--rows`` rows, 8 consecutive rows per prompt as GRPO submits a group, temperature 1, each row's length
drawn from a geometric law (mean about 15 tokens, at most 48) and given to both as its token budget with
no stop token, so both decode the same tokens' worth. All rows are queued at once through ``slots``
slots: ours, :class:`~unirl_lightning.engines.batcher.ContinuousBatcher` (``max_rows=slots``, stepped
on this thread); transformers', ``add_request`` per row on a manager of ``max_requests_per_batch=slots``
(its paged cache sized to the rows: ``page_size`` 64, a page a row), read with ``get_result``.
Completion tokens/s, rounds interleaved, medians.

Contracts, once each:

* **log-probs**: the returned behaviour log-prob of every token against ``log_softmax(logits / T)``
  recomputed by one forward over prompt + completion (the trainer's contract, ``old_logprob``), at
  temperature 0.7, then at 0.7 with ``top_p`` 0.9;
* **seeding**: 16 rows twice, and the first row alone; same tokens? (ours: a seed per row; transformers:
  ``add_request`` takes no seed, the manager one ``seed``);
* **a weight load in flight**: ``manager.pause()`` (transformers' in-place update: the loop stops
  between two steps, keeps its rows) around ``load_state_dict`` of perturbed weights while 64 rows run;
  how long the pause took to enter, and whether every row finished.

Writes benchmarks/results/transformers_cb.json.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from typing import Any

import torch

from benchmarks.harness import common
from benchmarks.performance.batcher_refill import long_tail_engine
from unirl_lightning.engines.batcher import BatchRow, ContinuousBatcher
from unirl_lightning.rollout.records import SamplingParams

MAX_NEW = 48


def workload(prompts: list[list[int]], rows: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``(prompt, length)`` per row: 8 rows a prompt, geometric lengths (mean about 15, at most 48)."""
    rng = random.Random(seed)
    return [
        (prompts[(i // 8) % len(prompts)], min(MAX_NEW, 1 + int(rng.expovariate(1 / 14))))
        for i in range(rows)
    ]


def ours(
    engine: Any, work: list[tuple[list[int], int]], slots: int, temperature: float = 1.0, top_p: float = 1.0
):
    """Every row through our batcher: (seconds, rows)."""
    batcher = ContinuousBatcher(
        engine.model, engine.device, stop_ids=[], pad_id=engine.tokenizer.pad_token_id, max_rows=slots
    )
    rows = [
        BatchRow(list(p), SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=n), seed=i)
        for i, (p, n) in enumerate(work)
    ]
    for row in rows:
        batcher.add(row)
    start = time.perf_counter()
    while batcher.pending:
        batcher.step()
    return time.perf_counter() - start, [(row.tokens, row.logprobs) for row in rows]


def manager(engine: Any, slots: int, temperature: float = 1.0, top_p: float = 1.0, seed: int | None = 0):
    """A started transformers manager: sampling at ``temperature`` / ``top_p``, log-probs returned,
    ``slots`` requests a batch, a 64-token page per row."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    generation = GenerationConfig(
        do_sample=True, temperature=temperature, top_p=top_p, top_k=0, max_new_tokens=MAX_NEW, eos_token_id=-1
    )
    config = ContinuousBatchingConfig(
        return_logprobs=True,
        max_requests_per_batch=slots,
        page_size=64,
        num_blocks=slots + 8,
        max_batch_tokens=max(256, 8 * slots),
        seed=seed,
    )
    mgr = engine.model.init_continuous_batching(
        generation_config=generation, continuous_batching_config=config
    )
    mgr.start()
    return mgr


def theirs(mgr: Any, work: list[tuple[list[int], int]], during: Any = None, stamps: list | None = None):
    """Every row through a started manager: (seconds, rows); ``during()`` runs once the rows are queued;
    ``stamps`` (a list) receives every token's timestamp (``perf_counter``)."""
    start = time.perf_counter()
    ids = [mgr.add_request(list(p), max_new_tokens=n, record_timestamps=stamps is not None) for p, n in work]
    if during is not None:
        during()
    out: dict[str, Any] = {}
    while len(out) < len(ids):
        result = mgr.get_result(timeout=120)
        if result is None:
            raise RuntimeError(f"transformers' manager returned {len(out)} of {len(ids)} rows")
        out[result.request_id] = result
    seconds = time.perf_counter() - start
    if stamps is not None:
        stamps.extend(t for i in ids for t in out[i].timestamps or [])
    return seconds, [(list(out[i].generated_tokens), list(out[i].logprobs or [])) for i in ids]


def logprob_gap(engine: Any, work: list[tuple[list[int], int]], rows: list, temperature: float) -> float:
    """The largest |returned - log_softmax(logits / T)[token]| over every token of ``rows``."""
    gap = 0.0
    with torch.no_grad():
        for (prompt, _), (tokens, logprobs) in zip(work, rows, strict=True):
            ids = torch.tensor([list(prompt) + list(tokens)])
            logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            recomputed = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(tokens)[:, None])[
                :, 0
            ]
            gap = max(gap, (recomputed - torch.tensor(logprobs)).abs().max().item())
    return gap


def contracts(engine: Any, prompts: list[list[int]]) -> dict[str, Any]:
    work = workload(prompts, 16)
    out: dict[str, Any] = {"logprob_gap": {}, "seeding": {}}
    for name, top_p in (("temperature 0.7", 1.0), ("temperature 0.7, top_p 0.9", 0.9)):
        _, mine = ours(engine, work, 16, 0.7, top_p)
        mgr = manager(engine, 16, 0.7, top_p)
        _, got = theirs(mgr, work)
        mgr.stop(block=True)
        out["logprob_gap"][name] = {
            "ours": logprob_gap(engine, work, mine, 0.7),
            "transformers": logprob_gap(engine, work, got, 0.7),
        }
    for name in ("ours", "transformers"):
        runs = []
        for batch in (work, work, work[:1]):
            if name == "ours":
                runs.append(ours(engine, batch, 16)[1])
            else:
                mgr = manager(engine, 16)
                runs.append(theirs(mgr, batch)[1])
                mgr.stop(block=True)
        out["seeding"][name] = {
            "same_batch_twice_equal": runs[0] == runs[1],
            "row_alone_equals_row_in_batch": runs[2][0][0] == runs[0][0][0],
        }
    out["inflight_load"] = inflight_load(engine, prompts)
    return out


def inflight_load(engine: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """Perturbed weights loaded under ``manager.pause()`` while 64 rows of 48 tokens run; the tokens
    stamped before, inside and after the pause (none inside: a token's time tells its weights)."""
    work = [(prompts[i % len(prompts)], MAX_NEW) for i in range(64)]
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    perturbed = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in before.items()}
    mgr = manager(engine, 16)
    waited: list[float] = []
    window: list[float] = []  # the pause's start and end
    stamps: list[float] = []

    def load() -> None:
        time.sleep(0.05)
        start = time.perf_counter()
        with mgr.pause():
            window.append(time.perf_counter())
            waited.append(window[0] - start)
            engine.model.load_state_dict(perturbed)
            window.append(time.perf_counter())

    loader = threading.Thread(target=load)
    try:
        _, rows = theirs(mgr, work, during=loader.start, stamps=stamps)
        loader.join()
    finally:
        mgr.stop(block=True)
        engine.model.load_state_dict(before)
    return {
        "pause_entered_s": waited[0] if waited else None,
        "rows_finished": sum(len(tokens) == MAX_NEW for tokens, _ in rows),
        "rows": len(rows),
        "tokens_before_inside_after_pause": [
            sum(t < window[0] for t in stamps),
            sum(window[0] <= t <= window[1] for t in stamps),
            sum(t > window[1] for t in stamps),
        ],
    }


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--slots", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--out", default="transformers_cb", help="results file (a bare name: in the results folder)"
    )
    config = common.parse_config(parser)
    engine, prompts = long_tail_engine()
    work = workload(prompts, config["rows"])
    tokens = sum(n for _, n in work)
    runs = []
    for slots in config["slots"]:
        mgr = manager(engine, slots)
        theirs(mgr, work[:16])  # warm-up
        ours(engine, work[:16], slots)
        for round_ in range(config["rounds"]):
            order = ("ours", "transformers") if round_ % 2 == 0 else ("transformers", "ours")
            for name in order:
                seconds, rows = ours(engine, work, slots) if name == "ours" else theirs(mgr, work)
                assert sum(len(t) for t, _ in rows) == tokens, (
                    f"{name} decoded {sum(len(t) for t, _ in rows)}"
                )
                runs.append(
                    {"slots": slots, "engine": name, "round": round_, "tokens_per_s": tokens / seconds}
                )
        mgr.stop(block=True)
    summary: dict[str, Any] = {"speed": {}}
    for slots in config["slots"]:
        med = {
            name: statistics.median(
                r["tokens_per_s"] for r in runs if r["slots"] == slots and r["engine"] == name
            )
            for name in ("ours", "transformers")
        }
        summary["speed"][str(slots)] = {**med, "ours_over_transformers": med["ours"] / med["transformers"]}
        print(f"{slots:>4} slots: ours {med['ours']:.0f} tokens/s, transformers {med['transformers']:.0f}")
    summary["contracts"] = contracts(engine, prompts)
    common.finish({"summary": summary, "runs": runs, "tokens": tokens}, config["out"], summary, config=config)


if __name__ == "__main__":
    main()
