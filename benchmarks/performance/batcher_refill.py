"""The continuous HF engine's refill, staged against unstaged, on the batcher alone (no Ray, no trainer).

    python -m benchmarks.performance.batcher_refill [--slots 4 16 128] [--rows 512] [--rounds 3]

The long-tail workload's model (the tiny random Llama, hidden 64, 2 layers, one torch thread) on
:class:`~unirl_lightning.engines.batcher.ContinuousBatcher`: ``--rows`` seeded rows (temperature 1, up
to 64 new tokens, digit_successor prompts of two widths) queued at once, stepped until all finish.
``stage=True`` (the default) prefills waiting rows ``slots`` at a time and refills a finished row's slot
in place the step it finishes; ``stage=False`` is the earlier refill (one prefill forward per refill,
once ``compact_at`` rows finished). Per configuration: completion tokens/s, occupancy (active rows /
slots over the wall clock, as ``rollout/engine_occupancy`` counts it) and prefill forwards; the two
refills must sample the same tokens (seeded rows do not depend on their batch), which is checked.
Rounds interleaved, medians. Writes benchmarks/results/batcher_refill.json.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from benchmarks.harness import common
from unirl_lightning import TinyCausalLM
from unirl_lightning.engines.batcher import BatchRow, ContinuousBatcher
from unirl_lightning.engines.hf import HFEngineConfig
from unirl_lightning.rollout.records import SamplingParams


def measure(engine: Any, prompts: list[list[int]], slots: int, rows: int, stage: bool) -> dict[str, Any]:
    batcher = ContinuousBatcher(
        engine.model,
        engine.device,
        stop_ids=list(engine.stop_ids),
        pad_id=engine.tokenizer.pad_token_id,
        max_rows=slots,
        tokenizer=engine.tokenizer,
        stage=stage,
    )
    prefills = [0]
    prefill = batcher._prefill

    def counted(batch: list[BatchRow]) -> Any:
        prefills[0] += 1
        return prefill(batch)

    batcher._prefill = counted
    sampling = SamplingParams(temperature=1.0, max_new_tokens=64)
    queued = [BatchRow(list(prompts[i % len(prompts)]), sampling, seed=i) for i in range(rows)]
    for row in queued:
        batcher.add(row)
    start = time.perf_counter()
    while batcher.pending:
        batcher.step()
    seconds = time.perf_counter() - start
    tokens = sum(len(row.tokens) for row in queued)
    return {
        "slots": slots,
        "stage": stage,
        "tokens_per_s": tokens / seconds,
        "occupancy": batcher.row_seconds / (slots * seconds),
        "prefills": prefills[0],
        "tokens": [row.tokens for row in queued],
    }


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--slots", type=int, nargs="+", default=[4, 16, 128])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--out", default="batcher_refill", help="results file (a bare name: in the results folder)"
    )
    config = common.parse_config(parser)
    torch.manual_seed(0)
    policy = TinyCausalLM(
        hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, max_position_embeddings=128
    )
    engine = HFEngineConfig(device="cpu", num_threads=1).build(policy)
    prompts = [policy.prompt_ids(engine.tokenizer, {"prompt": p}) for p in ("6=", "41=", "7=", "108=")]
    measure(engine, prompts, 4, 16, True)  # warm-up
    runs = []
    for round_ in range(config["rounds"]):
        for slots in config["slots"]:
            pair = [
                measure(engine, prompts, slots, config["rows"], stage)
                for stage in (round_ % 2 == 0, round_ % 2 == 1)
            ]
            if pair[0]["tokens"] != pair[1]["tokens"]:
                raise AssertionError(
                    f"slots={slots}: the staged and unstaged refills sampled different tokens"
                )
            runs += [{k: v for k, v in run.items() if k != "tokens"} | {"round": round_} for run in pair]
    summary = {}
    print(f"{'slots':>5} {'refill':>8} {'tokens/s':>9} {'occupancy':>9} {'prefills':>8}")
    for slots in config["slots"]:
        row = {}
        for stage in (False, True):
            mine = [r for r in runs if r["slots"] == slots and r["stage"] == stage]
            med = {
                k: statistics.median(r[k] for r in mine) for k in ("tokens_per_s", "occupancy", "prefills")
            }
            row["staged" if stage else "unstaged"] = med
            print(
                f"{slots:>5} {'staged' if stage else 'unstaged':>8} {med['tokens_per_s']:>9.0f} {med['occupancy']:>9.3f} {med['prefills']:>8.0f}"
            )
        row["staged_over_unstaged"] = row["staged"]["tokens_per_s"] / row["unstaged"]["tokens_per_s"]
        summary[str(slots)] = row
    common.finish({"summary": summary, "runs": runs}, config["out"], summary, config=config)


if __name__ == "__main__":
    main()
