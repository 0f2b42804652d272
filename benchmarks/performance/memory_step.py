"""Peak host memory of one GRPO training step against ``unirl-lightning plan``'s estimate (CPU only).

One optimizer step of full fine-tuning (no LoRA) over 16 rows of 154 tokens (90 prompt + 64
completion, the CPU recipe's shapes), with a KL term and recomputed old log-probs (so the no-grad
recompute over all rows runs too), in a fresh process per configuration, on three models:

* ``tiny-256``: a random-init Llama, hidden 256, 4 layers, 4 heads, MLP 688, vocabulary 32,000;
* ``tiny-512``: hidden 512, 8 layers, 8 heads, MLP 1376, vocabulary 32,000;
* ``smollm2``: SmolLM2-135M-Instruct (hidden 576, 30 layers, vocabulary 49,152, tied embedding);

each in float32 and in bf16 autocast over float32 masters, with and without gradient checkpointing,
every row in one micro-batch; and SmolLM2 without checkpointing at ``micro_batch_rows`` 4 and 1.

The figure is the peak resident set size during the step (``VmHWM``, reset just before it through
``/proc/self/clear_refs``) above the resident size just before it, once the model, the KL reference,
the batch and AdamW's two moments exist (the optimizer is stepped once on zero gradients first: a
step without gradients allocates no state). So it is what the step adds: the float32 gradients, the
activations, the logits and what comes with them, which is what the plan's
:func:`~unirl_lightning.planning.plan.step_peak` estimates; the record has both, and their ratio
(``--reestimate`` recomputes the estimates of the recorded peaks after a formula change).

Writes ``benchmarks/results/memory_step.json`` and prints a markdown table.

    python -m benchmarks.performance.memory_step [--models tiny-256 tiny-512 smollm2] [--reestimate]
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import common, stats

ROWS, PROMPT, COMPLETION = 16, 90, 64
MIB = 2**20
TINY = {
    "tiny-256": dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=688),
    "tiny-512": dict(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1376),
}
TINY_VOCAB = 32_000
MODELS = (*TINY, "smollm2")


def status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == key:
            return int(value.split()[0]) / 1024
    raise KeyError(key)


def policy_spec(model: str, dtype: str) -> Any:
    from unirl_lightning.models.causal_lm import PretrainedCausalLM, TinyCausalLM

    if model == "smollm2":
        return PretrainedCausalLM(name_or_path="smollm2-135m-instruct", dtype=dtype, chat=True)
    return TinyCausalLM(**TINY[model], max_position_embeddings=256, vocab_size=TINY_VOCAB, dtype=dtype)


def model_shape(model: str) -> dict[str, Any]:
    """The plan's :class:`~unirl_lightning.planning.plan.ModelShape` of ``model``, from its config alone."""
    import dataclasses

    from transformers import AutoConfig

    from unirl_lightning.core.prompts import build_char_tokenizer
    from unirl_lightning.planning.plan import ModelShape

    spec = policy_spec(model, "float32")
    if model == "smollm2":
        config = AutoConfig.from_pretrained(spec.pretrained_path()).to_dict()
    else:
        config = spec.llama_config(build_char_tokenizer()).to_dict()
    return dataclasses.asdict(ModelShape.from_config(config))


def estimate(result: dict[str, Any]) -> dict[str, float]:
    """What the plan says the measured step adds (MiB): :func:`~unirl_lightning.planning.plan.step_estimate` with
    the float32 gradients of every parameter (full fine-tuning), for ``result``'s model shape, dtype,
    checkpointing and micro-batches."""
    from unirl_lightning.planning.plan import ModelShape, step_estimate

    shape = ModelShape(**result["shape"])
    rows = result["micro_batch_rows"] or ROWS
    dtype_bytes = 2 if result["dtype"] == "bfloat16" else 4
    terms, peak = step_estimate(
        shape,
        rows * (PROMPT + COMPLETION),
        rows * (COMPLETION + 1),
        dtype_bytes,
        result["checkpointing"],
        gradients=4 * shape.params,
        micro_batches=-(-ROWS // rows),
        autocast_params=shape.params if dtype_bytes == 2 else 0,
    )
    return {f"{k}_mb": v / MIB for k, v in terms.items()} | {"estimate_mb": peak / MIB}


def child(config: dict) -> dict[str, Any]:
    """One configuration's step in this process: its peak above start, and the estimate."""
    import torch

    from unirl_lightning.modules import GRPOModule
    from unirl_lightning.rollout.batches import ExperienceBatch
    from unirl_lightning.rollout.records import Rollout

    torch.set_num_threads(2)
    module = GRPOModule(
        policy=policy_spec(config["model"], config["dtype"]),
        num_generations=8,
        max_new_tokens=COMPLETION,
        kl_coef=0.01,
        old_logprob="recompute",
        micro_batch_rows=config["micro_batch_rows"],
        gradient_checkpointing=config["checkpointing"],
    )
    module.setup("fit")  # the KL reference; float32 masters under bf16 compute
    optimizer = module.configure_optimizers()
    module.optimizers = lambda: optimizer
    module.manual_backward = lambda loss: loss.backward()
    module.clip_gradients = lambda *args, **kwargs: None
    vocab = module.policy.config.vocab_size
    g = torch.Generator().manual_seed(0)
    groups = [
        [
            Rollout(
                prompt_ids=torch.randint(100, vocab, (PROMPT,), generator=g).tolist(),
                completion_ids=torch.randint(100, vocab, (COMPLETION,), generator=g).tolist(),
                logprobs=(-3.0 + torch.randn(COMPLETION, generator=g)).tolist(),
                reward=float((group * 8 + k) % 2),
                finish_reason="length",
            )
            for k in range(8)
        ]
        for group in range(ROWS // 8)
    ]
    batch = ExperienceBatch.collate(groups, pad_token_id=0)
    # AdamW allocates its moments at the first step that has gradients: step once on zeros (no update
    # at weight_decay 0), so the measured step is a steady one
    trainable = [p for p in module.policy.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start_rss = status_mb("VmRSS")
    start = time.perf_counter()
    context = module.prepare_batch(batch)
    module.update(batch, context)
    seconds = time.perf_counter() - start
    peak = status_mb("VmHWM")
    return {**config, "peak_above_start_mb": peak - start_rss, "seconds": seconds}


def configs(models: list[str], smoke: bool = False) -> list[dict[str, Any]]:
    """Every model x dtype x checkpointing with every row in one micro-batch, then SmolLM2 without
    checkpointing at 4 and 1 rows per micro-batch (``smoke``: the first model in float32 only)."""
    if smoke:
        return [{"model": models[0], "dtype": "float32", "checkpointing": False, "micro_batch_rows": None}]
    grid = [
        {"model": model, "dtype": dtype, "checkpointing": checkpointing, "micro_batch_rows": None}
        for model in models
        for dtype in ("float32", "bfloat16")
        for checkpointing in (False, True)
    ]
    if "smollm2" in models:
        grid += [
            {"model": "smollm2", "dtype": dtype, "checkpointing": False, "micro_batch_rows": rows}
            for dtype in ("float32", "bfloat16")
            for rows in (4, 1)
        ]
    return grid


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Every configuration, each in a fresh process; the results record."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(256 * 1024))  # as memory.py
    results = []
    for cfg in configs(config["models"], config["smoke"]):
        result = common.run_child(Path(__file__), cfg, timeout_s=1800)
        result["shape"] = model_shape(cfg["model"])
        result.update(estimate(result))
        print(
            f"{cfg['model']:9s} {cfg['dtype']:8s} checkpointing={cfg['checkpointing']!s:5s} "
            f"rows={cfg['micro_batch_rows']!s:4s} peak +{result['peak_above_start_mb']:6.0f} MB, "
            f"estimate {result['estimate_mb']:6.0f} MB",
            flush=True,
        )
        results.append(result)
    return {"rows": ROWS, "row_tokens": PROMPT + COMPLETION, "machine": stats.machine(), "results": results}


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | compute | checkpointing | micro_batch_rows | estimate (MB) | measured (MB) | estimate / measured |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        compute = "float32" if r["dtype"] == "float32" else "bf16 autocast"
        rows = f"all {ROWS}" if r["micro_batch_rows"] is None else r["micro_batch_rows"]
        lines.append(
            f"| {r['model']} | {compute} | {'yes' if r['checkpointing'] else 'no'} | {rows} | "
            f"{r['estimate_mb']:,.0f} | {r['peak_above_start_mb']:,.0f} | "
            f"{r['estimate_mb'] / r['peak_above_start_mb']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--smoke", action="store_true", help="one configuration (the first model, float32)")
    parser.add_argument(
        "--reestimate",
        action="store_true",
        help="measure nothing: recompute the estimates of the recorded results (after a formula change)",
    )
    config = common.parse_config(parser, child=child)
    if config["reestimate"]:
        record = json.loads(common.results_path("memory_step").read_text())
        for result in record["results"]:
            result["shape"] = result.get("shape") or model_shape(result["model"])
            result.update(estimate(result))
    else:
        record = run(config)
    print(table(record["results"]))
    ratios = {
        f"{r['model']} {r['dtype']} ckpt={r['checkpointing']} rows={r['micro_batch_rows']}": round(
            r["estimate_mb"] / r["peak_above_start_mb"], 2
        )
        for r in record["results"]
    }
    common.finish(record, "memory_step", {"estimate_over_measured": ratios}, config=config)


if __name__ == "__main__":
    main()
