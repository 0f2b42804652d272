"""The continuous HF engine's decode-step cost against active rows and context, on this machine: the
engine costs ``simulate_streaming --parts here`` calibrates with.

    python -m benchmarks.performance.engine_step_cost [--rows 1 2 4 8 16 32 64 128] [--tokens 48] [--rounds 3]

The long-tail workload's model (the tiny random Llama, hidden 64, 2 layers, one torch thread) on the
engine's own :class:`~unirl_lightning.engines.batcher.ContinuousBatcher`, with no stop token, so every
row decodes ``--tokens`` tokens: ``R`` rows join at once (one prefill, timed), then every decode step is
timed with its active rows and their context tokens. A least-squares fit of ``a + b*rows + c*context``
over every step of every ``R`` (rounds interleaved) is the simulator's decode cost; the prefill cost
per prompt token is the join step's time less one decode step's, over the prompt tokens.

The refill (``--refill-slots``): ``--refill-rows`` rows in groups of 8 sharing a prompt, lengths drawn
from a geometric law (mean about 15 tokens, at most 48), through ``S`` slots with the staged refill as
the engine runs it. The time in the batcher's refill code (its stage prefills, writing rows into slots,
appending, compacting), less what the simulator charges already (one forward's ``a`` per stage and the
prefill of each distinct prompt), per row admitted, is ``refill_s_per_row``.
Writes benchmarks/results/engine_step_cost.json (the fit, its relative error per ``R``, the refill
cost, and the medians).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch

from benchmarks.harness import common
from unirl_lightning import TinyCausalLM
from unirl_lightning.engines.batcher import BatchRow, ContinuousBatcher
from unirl_lightning.engines.hf import HFEngineConfig
from unirl_lightning.rollout.records import SamplingParams


def measure(
    model: Any, device: torch.device, pad_id: int, prompt: list[int], rows: int, tokens: int
) -> dict[str, Any]:
    # every row's prompt prefilled (not one per distinct prompt): the join times the per-token prefill
    batcher = ContinuousBatcher(model, device, stop_ids=[], pad_id=pad_id, max_rows=rows, share_prompts=False)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=tokens)
    for i in range(rows):
        batcher.add(BatchRow(list(prompt), sampling, seed=i))
    start = time.perf_counter()
    batcher.step()  # the join: prefill of every row and its first token
    join_s = time.perf_counter() - start
    steps = []
    while batcher.live:
        context = sum(len(row.prompt_ids) + len(row.tokens) for row in batcher.active)
        start = time.perf_counter()
        active = batcher.step()
        steps.append((active, context, time.perf_counter() - start))
    return {"rows": rows, "join_s": join_s, "steps": steps}


def refill_cost(
    model: Any, device: torch.device, pad_id: int, prompts: list[list[int]], slots: int, rows: int, fit: dict
) -> dict[str, float]:
    """Seconds per admitted row in the batcher's refill code (the stage's prefill forwards beyond the
    simulator's ``a`` per forward and per-token prefill of each distinct prompt; writing a row into a
    slot, appending rows, compacting), timed around those methods (see the module docstring)."""
    batcher = ContinuousBatcher(model, device, stop_ids=[], pad_id=pad_id, max_rows=slots)
    rng = random.Random(0)
    for i in range(rows):
        length = min(48, 1 + int(rng.expovariate(1 / 14)))
        prompt = prompts[(i // 8) % len(prompts)]
        batcher.add(BatchRow(list(prompt), SamplingParams(temperature=1.0, max_new_tokens=length), seed=i))
    spent = dict.fromkeys(("_stage_for", "_replace", "_admit", "_select"), 0.0)
    counts = {"stages": 0, "prompt_tokens": 0}  # stage forwards, and the distinct prompts' tokens in them

    def timed(name: str) -> Any:
        method = getattr(batcher, name)

        def run(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args)
            finally:
                spent[name] += time.perf_counter() - start

        return run

    prefill = batcher._prefill

    def counted(batch: list[BatchRow]) -> Any:
        counts["stages"] += 1
        counts["prompt_tokens"] += sum(len(row.prompt_ids) for row in batch)
        return prefill(batch)

    batcher._prefill = counted
    for name in spent:
        setattr(batcher, name, timed(name))
    while batcher.pending:
        batcher.step()
    modelled = counts["stages"] * fit["a"] + counts["prompt_tokens"] * fit["prefill_s_per_token"]
    return {
        "slots": slots,
        "spent": spent,
        **counts,
        "refill_s_per_row": (sum(spent.values()) - modelled) / rows,
    }


def fit(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least squares of ``seconds = a + b*rows + c*context`` (normal equations, 3x3)."""
    x = torch.tensor([[1.0, r, c] for r, c, _ in points], dtype=torch.float64)
    y = torch.tensor([s for *_, s in points], dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1).tolist()
    return coef[0], coef[1], coef[2]


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--tokens", type=int, default=48, help="decode steps per row (no stop token)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--refill-slots", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--refill-rows", type=int, default=512)
    parser.add_argument(
        "--out", default="engine_step_cost", help="results file (a bare name: in the results folder)"
    )
    config = common.parse_config(parser)
    policy = TinyCausalLM(
        hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, max_position_embeddings=128
    )
    engine = HFEngineConfig(device="cpu", num_threads=1).build(policy)  # its model, tokenizer, device
    prompt = policy.prompt_ids(engine.tokenizer, {"prompt": "6="})  # a digit_successor prompt, as served
    runs = []
    for round_ in range(config["rounds"]):
        order = config["rows"] if round_ % 2 == 0 else config["rows"][::-1]
        for rows in order:
            runs.append(
                measure(
                    engine.model, engine.device, engine.tokenizer.pad_token_id, prompt, rows, config["tokens"]
                )
            )
    points = [point for run in runs for point in run["steps"]]
    a, b, c = fit(points)
    per_rows = {}
    for rows in config["rows"]:
        mine = [run for run in runs if run["rows"] == rows]
        measured = statistics.median(s for run in mine for *_, s in run["steps"])
        predicted = statistics.median(a + b * r + c * ctx for run in mine for r, ctx, _ in run["steps"])
        decode = statistics.median(run["join_s"] for run in mine) - predicted
        per_rows[str(rows)] = {
            "step_s": measured,
            "fit_s": predicted,
            "fit_error": predicted / measured - 1,
            "tokens_per_s": rows / measured,
            "prefill_s_per_token": max(0.0, decode) / (rows * len(prompt)),
        }
    prefill = statistics.median(v["prefill_s_per_token"] for v in per_rows.values())
    summary = {"a": a, "b": b, "c": c, "prefill_s_per_token": prefill, "prompt_len": len(prompt)}
    summary["per_rows"] = per_rows
    prompts = [policy.prompt_ids(engine.tokenizer, {"prompt": p}) for p in ("6=", "4=", "7=", "1=")]
    refills = [
        refill_cost(
            engine.model,
            engine.device,
            engine.tokenizer.pad_token_id,
            prompts,
            slots,
            config["refill_rows"],
            summary,
        )
        for _ in range(config["rounds"])
        for slots in config["refill_slots"]
    ]
    summary["refill"] = {
        str(slots): statistics.median(r["refill_s_per_row"] for r in refills if r["slots"] == slots)
        for slots in config["refill_slots"]
    }
    summary["refill_s_per_row"] = statistics.median(summary["refill"].values())
    print(
        f"step = {a * 1e3:.3f} ms + {b * 1e6:.2f} us x rows + {c * 1e9:.2f} ns x context; prefill {prefill * 1e6:.1f} us/token"
    )
    print(
        f"refill {summary['refill_s_per_row'] * 1e6:.1f} us a row beyond the modelled forwards: {summary['refill']}"
    )
    for rows, v in per_rows.items():
        print(
            f"  rows {rows:>4}: {v['step_s'] * 1e3:7.3f} ms/step, {v['tokens_per_s']:8.0f} tokens/s, "
            f"fit {v['fit_error']:+.1%}"
        )
    common.write_results({"summary": summary, "config": config | {"out": None}}, config["out"], config=config)


if __name__ == "__main__":
    main()
