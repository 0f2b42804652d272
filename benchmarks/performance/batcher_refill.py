"""The continuous HF engine's refill, staged against unstaged, on the batcher alone (no Ray, no trainer).

    python -m benchmarks.performance.batcher_refill [--slots 4 16 128] [--rows 512] [--group 8] [--rounds 3]

The long-tail workload's model (the tiny random Llama, hidden 64, 2 layers, one torch thread) on
:class:`~unirl_lightning.engines.batcher.ContinuousBatcher`: ``--rows`` seeded rows (temperature 1, up
to 64 new tokens, digit_successor prompts of two widths, ``--group`` consecutive rows per prompt as GRPO
submits a prompt's samples) queued at once, stepped until all finish. Three refills: ``shared`` (the
default: waiting rows prefilled ``slots`` at a time, one prefill per distinct prompt among them, and a
finished row's slot refilled in place the step it finishes), ``staged`` (the same, every row's prompt
prefilled: ``share_prompts=False``) and ``unstaged`` (``stage=False``: one prefill forward per refill,
once ``compact_at`` rows finished). Per configuration: completion tokens/s, occupancy (active rows /
slots over the wall clock, as ``rollout/engine_occupancy`` counts it), prefill forwards and prompt rows
prefilled; the refills must sample the same tokens (seeded rows do not depend on their batch), which is
checked. Rounds interleaved, medians. Writes benchmarks/results/batcher_refill.json.
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

REFILLS = {"unstaged": (False, False), "staged": (True, False), "shared": (True, True)}  # (stage, share)


def long_tail_engine() -> tuple[Any, list[list[int]]]:
    """The long-tail workload's model (seeded) as the HF engine builds it on one torch thread, and four
    digit_successor prompts of two widths."""
    torch.manual_seed(0)
    policy = TinyCausalLM(
        hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, max_position_embeddings=128
    )
    engine = HFEngineConfig(device="cpu", num_threads=1).build(policy)
    return engine, [policy.prompt_ids(engine.tokenizer, {"prompt": p}) for p in ("6=", "41=", "7=", "108=")]


def measure(
    engine: Any, prompts: list[list[int]], slots: int, rows: int, group: int, refill: str
) -> dict[str, Any]:
    stage, share = REFILLS[refill]
    batcher = ContinuousBatcher(
        engine.model,
        engine.device,
        stop_ids=list(engine.stop_ids),
        pad_id=engine.tokenizer.pad_token_id,
        max_rows=slots,
        tokenizer=engine.tokenizer,
        stage=stage,
        share_prompts=share,
    )
    prefills = [0, 0]  # forwards, prompt rows
    prefill = batcher._prefill

    def counted(batch: list[BatchRow]) -> Any:
        prefills[0] += 1
        prefills[1] += len(batch)
        return prefill(batch)

    batcher._prefill = counted
    sampling = SamplingParams(temperature=1.0, max_new_tokens=64)
    queued = [BatchRow(list(prompts[(i // group) % len(prompts)]), sampling, seed=i) for i in range(rows)]
    for row in queued:
        batcher.add(row)
    start = time.perf_counter()
    while batcher.pending:
        batcher.step()
    seconds = time.perf_counter() - start
    tokens = sum(len(row.tokens) for row in queued)
    return {
        "slots": slots,
        "refill": refill,
        "tokens_per_s": tokens / seconds,
        "occupancy": batcher.row_seconds / (slots * seconds),
        "prefills": prefills[0],
        "prefill_rows": prefills[1],
        "tokens": [row.tokens for row in queued],
    }


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--slots", type=int, nargs="+", default=[4, 16, 128])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--group", type=int, default=8, help="consecutive rows per prompt (a GRPO group)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--out", default="batcher_refill", help="results file (a bare name: in the results folder)"
    )
    config = common.parse_config(parser)
    engine, prompts = long_tail_engine()
    measure(engine, prompts, 4, 16, 4, "shared")  # warm-up
    runs = []
    names = list(REFILLS)
    for round_ in range(config["rounds"]):
        for slots in config["slots"]:
            order = names[round_ % 3 :] + names[: round_ % 3]  # rotated: none always runs first
            done = [measure(engine, prompts, slots, config["rows"], config["group"], r) for r in order]
            if any(run["tokens"] != done[0]["tokens"] for run in done):
                raise AssertionError(f"slots={slots}: the refills sampled different tokens")
            runs += [{k: v for k, v in run.items() if k != "tokens"} | {"round": round_} for run in done]
    summary = {}
    keys = ("tokens_per_s", "occupancy", "prefills", "prefill_rows")
    print(f"{'slots':>5} {'refill':>8} {'tokens/s':>9} {'occupancy':>9} {'prefills':>8} {'rows':>5}")
    for slots in config["slots"]:
        row = {}
        for refill in names:
            mine = [r for r in runs if r["slots"] == slots and r["refill"] == refill]
            med = row[refill] = {k: statistics.median(r[k] for r in mine) for k in keys}
            print(
                f"{slots:>5} {refill:>8} {med['tokens_per_s']:>9.0f} {med['occupancy']:>9.3f} "
                f"{med['prefills']:>8.0f} {med['prefill_rows']:>5.0f}"
            )
        row["staged_over_unstaged"] = row["staged"]["tokens_per_s"] / row["unstaged"]["tokens_per_s"]
        row["shared_over_staged"] = row["shared"]["tokens_per_s"] / row["staged"]["tokens_per_s"]
        summary[str(slots)] = row
    common.finish({"summary": summary, "runs": runs}, config["out"], summary, config=config)


if __name__ == "__main__":
    main()
