"""Peak host memory of the vocabulary-sized work: trainer log-probs and HF-engine generation, before/after.

Two measurements, each configuration in a fresh Python process (so one run's allocations never
lower or raise another's peak), on a tiny Llama built locally (hidden 64, one layer: the
vocabulary projection is nearly all of the memory) with a real model's vocabulary, 49152
(SmolLM2) or 151936 (Qwen2.5):

* ``logprobs``: one training step's log-prob forward + backward (``sequence_logprobs``' path: the
  float32 masters under bf16 autocast give bf16 logits; log-probs of every position at temperature
  0.7; ``backward`` of their sum) for a micro-batch of B sequences of T tokens. ``before`` is the
  row loop this library used (one float32 copy of each sequence's logits, every one kept for the
  backward, copied below), ``after`` is :func:`unirl_lightning.algorithms.token_logprobs` (chunked,
  saves the bf16 logits and one logsumexp per position).
* ``generate``: one HF-engine generation of B rows x N new tokens (temperature 1; a random model
  of this vocabulary essentially never samples EOS, so every row runs to N). ``before`` keeps
  ``output_logits`` for every step, stacks and upcasts them and takes the log-softmax (the engine's
  former code, copied below); ``after`` is :meth:`HFEngine.generate_ids` (log-probs scored step by
  step, one ``[B, V]`` row kept).

The figure reported is the peak resident set size of the measured call above the process's
resident size just before it (``ru_maxrss`` after, minus RSS before: the allocations the call
itself made, model and inputs excluded; glibc's mmap threshold is fixed so that freed buffers leave
the resident set). On a GPU the same code paths would be measured with
``torch.cuda.max_memory_allocated`` (see ``benchmarks/gpu/gpu_smoke.py``).

Writes ``benchmarks/results/memory.json``, ``memory.md`` (the table) and ``memory.png``.

    python -m benchmarks.performance.memory [--smoke]
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import common, figures, stats

# the measured sizes: micro-batches of `logprob_length` positions, generations of `generate_tokens`;
# `--smoke`: one small configuration of each kind (seconds, for make bench-smoke)
SIZES = {
    "full": dict(
        vocabs=(49152, 151936),
        logprob_batches=(1, 4, 8),
        logprob_length=128,
        generate_batches=(4, 16),
        generate_tokens=32,
    ),
    "smoke": dict(
        vocabs=(4096,), logprob_batches=(1,), logprob_length=16, generate_batches=(2,), generate_tokens=4
    ),
}
TEMPERATURE = 0.7
MB = 2**20


# -- the implementations replaced (kept here for the "before" column) -------------------------------
def old_token_logprobs(logits, tokens, temperature):
    """The former ``token_logprobs`` for bf16 logits: upcast one sequence at a time, but every
    sequence's float32 ``scaled`` is saved for logsumexp's backward (a float32 [B, T, V] in all)."""
    import torch

    rows = []
    for row_logits, row_index in zip(logits, tokens.long().unsqueeze(-1)):
        scaled = row_logits.float() / temperature
        rows.append(scaled.gather(-1, row_index).squeeze(-1) - torch.logsumexp(scaled, dim=-1))
    return torch.stack(rows)


def old_generate_logprobs(engine, prompts, max_new_tokens, temperature):
    """The former HF-engine scoring: keep ``output_logits`` of every step ([B, N, V] float32), stack
    (a second copy), divide, log-softmax (a third), gather."""
    import torch

    tok = engine.tokenizer
    width = max(len(ids) for ids in prompts)
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(ids)) + ids for ids in prompts])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
    out = engine.model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        pad_token_id=tok.pad_token_id,
        eos_token_id=engine.stop_ids,
        output_logits=True,
        return_dict_in_generate=True,
    )
    new_tokens = out.sequences[:, width:]
    logits = torch.stack(out.logits, dim=1).float() / temperature
    logps = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
    return new_tokens.tolist(), logps.cpu()


# -- one measurement per process --------------------------------------------------------------------
def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / MB


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def policy(vocab: int, dtype: str):
    from unirl_lightning.models.causal_lm import TinyCausalLM

    return TinyCausalLM(
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
        vocab_size=vocab,
        dtype=dtype,
    )


def child(config: dict) -> dict[str, Any]:
    """One measurement (``config``: kind, vocab, batch, impl, length or tokens) in this process: its peak
    above start."""
    import torch

    torch.set_num_threads(2)
    torch.manual_seed(0)
    vocab, batch, impl = config["vocab"], config["batch"], config["impl"]
    if config["kind"] == "logprobs":
        from unirl_lightning.algorithms import token_logprobs
        from unirl_lightning.modules.optim import upcast_trainable_parameters

        model, _ = policy(vocab, "bfloat16").build()
        upcast_trainable_parameters(model)  # the trainer's float32 masters, bf16 compute below
        input_ids = torch.randint(3, 24, (batch, config["length"]))
        compute = old_token_logprobs if impl == "before" else token_logprobs
        base = rss_mb()
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=input_ids).logits
        # as sequence_logprobs: the logits whole, a dummy token for the last position (dropped)
        targets = torch.nn.functional.pad(input_ids[:, 1:], (0, 1))
        logp = compute(logits, targets, TEMPERATURE)[:, :-1]
        del logits
        logp.sum().backward()
        elapsed = time.perf_counter() - start
        positions = batch * config["length"]
    else:
        from unirl_lightning.engines.hf import HFEngine, HFEngineConfig
        from unirl_lightning.rollout.records import SamplingParams

        engine = HFEngine(HFEngineConfig(device="cpu", num_threads=2), policy(vocab, "float32"), None)
        prompts = [torch.randint(3, 24, (8,)).tolist() for _ in range(batch)]
        sampling = SamplingParams(temperature=1.0, max_new_tokens=config["tokens"])
        base = rss_mb()
        start = time.perf_counter()
        with torch.no_grad():
            if impl == "before":
                tokens, _ = old_generate_logprobs(engine, prompts, config["tokens"], 1.0)
                generated = sum(len(t) for t in tokens)
            else:
                generated = sum(len(c) for c, _, _ in engine.generate_ids(prompts, sampling, seed=0))
        elapsed = time.perf_counter() - start
        positions = generated
    peak = peak_rss_mb()
    return {
        **config,
        "peak_above_start_mb": peak - base,
        "start_rss_mb": base,
        "seconds": elapsed,
        "positions": positions,
        # one float32 [positions, V] tensor, for scale
        "float32_bvt_mb": positions * vocab * 4 / MB,
    }


def configurations(sizes: dict[str, Any]) -> list[dict]:
    configs = []
    for vocab in sizes["vocabs"]:
        for batch in sizes["logprob_batches"]:
            for impl in ("before", "after"):
                length = sizes["logprob_length"]
                configs.append(
                    {"kind": "logprobs", "vocab": vocab, "batch": batch, "impl": impl, "length": length}
                )
        for batch in sizes["generate_batches"]:
            for impl in ("before", "after"):
                tokens = sizes["generate_tokens"]
                configs.append(
                    {"kind": "generate", "vocab": vocab, "batch": batch, "impl": impl, "tokens": tokens}
                )
    return configs


def table(results: list[dict]) -> str:
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in results:
        by_key.setdefault((r["kind"], r["vocab"], r["batch"]), {})[r["impl"]] = r
    lines = [
        "| measurement | vocab | micro-batch | positions | float32 [B,T,V] MB | before peak MB | after peak MB "
        "| after / before | before s | after s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (kind, vocab, batch), pair in sorted(by_key.items()):
        before, after = pair["before"], pair["after"]
        what = (
            f"log-prob fwd+bwd (T={after['length']})"
            if kind == "logprobs"
            else f"HF generate (N={after['tokens']})"
        )
        lines.append(
            f"| {what} | {vocab} | {batch} | {after['positions']} | {after['float32_bvt_mb']:.0f} "
            f"| {before['peak_above_start_mb']:.0f} | {after['peak_above_start_mb']:.0f} "
            f"| {after['peak_above_start_mb'] / max(before['peak_above_start_mb'], 1e-9):.2f} "
            f"| {before['seconds']:.2f} | {after['seconds']:.2f} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    fig, axes = figures.pyplot().subplots(1, 2, figsize=(11, 4))
    for ax, kind, title in (
        (axes[0], "logprobs", "log-prob forward+backward, T={length}"),
        (axes[1], "generate", "HF generation, {tokens} new tokens"),
    ):
        sample = next(r for r in results if r["kind"] == kind)
        title = title.format(length=sample.get("length"), tokens=sample.get("tokens"))
        vocabs = sorted({r["vocab"] for r in results})
        for vocab, marker in zip(vocabs, ("o", "s")):
            for impl, style in (("before", "--"), ("after", "-")):
                rows = sorted(
                    (r for r in results if r["kind"] == kind and r["vocab"] == vocab and r["impl"] == impl),
                    key=lambda r: r["batch"],
                )
                ax.plot(
                    [r["batch"] for r in rows],
                    [r["peak_above_start_mb"] for r in rows],
                    style,
                    marker=marker,
                    label=f"{impl}, V={vocab}",
                )
        ax.set_xlabel("micro-batch size (sequences)")
        ax.set_ylabel("peak RSS above start (MB)")
        ax.set_title(title)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    figures.save_figure(fig, path)


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Every configuration, each in a fresh process (``smoke``: all in this one, which checks the code
    paths, not the figures); the results record."""
    # a fixed mmap threshold: every large buffer is its own mapping, returned when freed, so the
    # peak RSS follows the live allocations (glibc's adaptive threshold otherwise keeps freed
    # step-sized buffers in the heap, and the generation figures wander by hundreds of MB)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(256 * 1024))
    results = []
    for measurement in configurations(SIZES["smoke" if config["smoke"] else "full"]):
        if config["smoke"]:
            result = child(measurement)
        else:
            result = common.run_child(Path(__file__), measurement, timeout_s=600)
        print(
            f"{measurement['kind']:9s} V={measurement['vocab']:6d} B={measurement['batch']:2d} "
            f"{measurement['impl']:6s} peak +{result['peak_above_start_mb']:7.0f} MB  {result['seconds']:.2f} s",
            flush=True,
        )
        results.append(result)
    return {"machine": stats.machine(), "results": results}


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one small configuration of each kind, in this process (seconds; the figures mean nothing)",
    )
    config = common.parse_config(parser, child=child)
    record = run(config)
    markdown = table(record["results"])
    out = common.write_results(record, "memory", config=config)
    out.with_suffix(".md").write_text(markdown + "\n")
    plot(record["results"], out.with_suffix(".png"))
    print(markdown)
    print(json.dumps({"written": [str(out.with_suffix(ext)) for ext in (".json", ".md", ".png")]}))


if __name__ == "__main__":
    main()
