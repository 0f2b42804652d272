"""Peak host memory of one SmolLM2-135M training step, with and without micro-batching.

One GRPO optimizer step of full fine-tuning (no LoRA) on SmolLM2-135M-Instruct (vocabulary 49,152)
over 16 rows of 154 tokens (90 prompt + 64 completion, the CPU recipe's shapes), with a KL term and
recomputed old log-probs (so the no-grad recompute over all rows runs too), in a fresh process per
configuration: ``micro_batch_rows`` None (every row in one forward and one backward), 4 and 1, in
float32 and in bf16 compute over float32 master weights. The figure is the peak resident set size
of the step above the process's resident size just before it (model, optimizer and batch built
first), as in ``benchmarks/memory.py``.

Writes ``benchmarks/results/memory_step.json`` and prints a markdown table.

    python benchmarks/memory_step.py
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any

import common

ROWS, PROMPT, COMPLETION = 16, 90, 64
MB = 2**20


def child(config: dict) -> dict[str, Any]:
    """One configuration's step in this process: its peak above start."""
    import psutil
    import torch

    from unirl_lightning.models import PretrainedCausalLM
    from unirl_lightning.modules import GRPOModule
    from unirl_lightning.rollout.batches import ExperienceBatch
    from unirl_lightning.rollout.records import Rollout

    torch.set_num_threads(2)
    module = GRPOModule(
        policy=PretrainedCausalLM(name_or_path="smollm2-135m-instruct", dtype=config["dtype"], chat=True),
        num_generations=8,
        max_new_tokens=COMPLETION,
        kl_coef=0.01,
        old_logprob="recompute",
        micro_batch_rows=config["micro_batch_rows"],
    )
    module.setup("fit")  # float32 masters under bf16 compute
    optimizer = module.configure_optimizers()
    module.optimizers = lambda: optimizer
    module.manual_backward = lambda loss: loss.backward()
    module.clip_gradients = lambda *args, **kwargs: None
    g = torch.Generator().manual_seed(0)
    groups = [
        [
            Rollout(
                prompt_ids=torch.randint(100, 40000, (PROMPT,), generator=g).tolist(),
                completion_ids=torch.randint(100, 40000, (COMPLETION,), generator=g).tolist(),
                logprobs=(-3.0 + torch.randn(COMPLETION, generator=g)).tolist(),
                reward=float((group * 8 + k) % 2),
                finish_reason="length",
            )
            for k in range(8)
        ]
        for group in range(ROWS // 8)
    ]
    batch = ExperienceBatch.collate(groups, pad_token_id=0)
    # warm the optimizer state (AdamW allocates it at its first step) so the measured step is a steady one
    optimizer.step()
    start_rss = psutil.Process().memory_info().rss / MB
    start = time.perf_counter()
    context = module.prepare_batch(batch)
    module.update(batch, context)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {**config, "peak_above_start_mb": peak - start_rss, "seconds": seconds}


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Every dtype and micro-batch size, each in a fresh process; the results record."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(256 * 1024))  # as benchmarks/memory.py
    results = []
    for dtype in ("float32", "bfloat16"):
        for rows in (None, 4, 1):
            cfg = {"dtype": dtype, "micro_batch_rows": rows}
            result = common.run_child(Path(__file__), cfg, timeout_s=1200)
            print(
                f"{dtype:8s} micro_batch_rows={rows!s:4s} peak +{result['peak_above_start_mb']:6.0f} MB",
                flush=True,
            )
            results.append(result)
    return {"machine": common.machine(), "results": results}


def main() -> None:
    config = common.parse_config(common.script_parser(__doc__), child=child)
    record = run(config)
    results = record["results"]
    lines = [
        f"| SmolLM2-135M step, {ROWS} x {PROMPT + COMPLETION} tokens | micro_batch_rows | peak MB above start | s |",
        "|---|---:|---:|---:|",
    ]
    for r in results:
        compute = "float32" if r["dtype"] == "float32" else "bf16 compute, fp32 masters"
        rows = "all (none)" if r["micro_batch_rows"] is None else r["micro_batch_rows"]
        lines.append(f"| {compute} | {rows} | {r['peak_above_start_mb']:.0f} | {r['seconds']:.1f} |")
    print("\n".join(lines))
    peaks = {f"{r['dtype']} rows={r['micro_batch_rows']}": round(r["peak_above_start_mb"]) for r in results}
    common.finish(record, "memory_step", {"peak_above_start_mb": peaks})


if __name__ == "__main__":
    main()
