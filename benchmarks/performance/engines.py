"""Rollout engines head to head: generation tokens/s and time per weight push, HF vs vLLM.

Both engines run in this process on the same model — the real SmolLM2-135M-Instruct with its chat
template (``--model smollm2``, the default; needs the real-model extra) or the tiny Llama of the CPU
demo (``--model tiny``) — and get the same GRPO-shaped requests (word problems for SmolLM2): ``--prompts`` prompts x ``--n`` samples x ``--max-new-tokens`` tokens at
temperature 1, seeded. After ``--warmup`` untimed requests, ``--repeats`` requests are timed; tokens/s
counts the completion tokens actually generated (eos-terminated samples are shorter). Weight pushes
are timed over ``--pushes`` calls of ``engine.load_weights``: full weights for both engines, and a
LoRA adapter (rank 8 on every projection) for vLLM. The HF engine runs with as many torch threads as
vLLM's CPU worker binds (every core), so neither gets more of the machine.

Prints a table and, as the last line, a JSON record that is also written to
``benchmarks/results/engines.json``. Needs vLLM (``make test-vllm`` builds ``.venv-vllm``; run
``.venv-vllm/bin/python -m benchmarks.performance.engines``, or ``make bench-engines``); without it only the HF engine is measured.

Usage::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python -m benchmarks.performance.engines [--prompts 16] [--n 8] [--max-new-tokens 32]
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any

from benchmarks.harness import common

PROMPTS = ["1+2=", "3*4=", "7=", "12-5=", "9*9=", "4+4=", "0=", "8-3="]


def set_environment() -> None:
    """Before vLLM is imported: its engine core in this process, quiet."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def requests(config: dict[str, Any], count: int, first_seed: int):
    from unirl_lightning.data import make_task
    from unirl_lightning.rollout.records import RolloutRequest, SamplingParams

    if config["model"] == "smollm2":
        records = make_task("word_problems", config["prompts"], seed=0, difficulty="easy")
    else:
        records = [{"prompt": PROMPTS[i % len(PROMPTS)]} for i in range(config["prompts"])]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=config["max_new_tokens"])
    return [
        RolloutRequest(records, n=config["n"], sampling=sampling, seed=first_seed + i) for i in range(count)
    ]


def time_generation(engine, config: dict[str, Any]) -> dict:
    for request in requests(config, config["warmup"], first_seed=10_000):
        engine.generate(request)
    tokens, seconds = 0, 0.0
    for request in requests(config, config["repeats"], first_seed=0):
        start = time.perf_counter()
        groups = engine.generate(request)
        seconds += time.perf_counter() - start
        tokens += sum(len(r.completion_ids) for g in groups for r in g)
    return {
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
        "generate_s": seconds,
        "s_per_request": seconds / config["repeats"],
    }


def time_pushes(engine, tensors: dict, pushes: int) -> dict:
    times = []
    for version in range(1, pushes + 1):
        start = time.perf_counter()
        engine.load_weights(tensors.items(), weight_version=version)
        times.append(time.perf_counter() - start)
    return {
        "push_ms_median": statistics.median(times) * 1e3,
        "push_ms_mean": statistics.fmean(times) * 1e3,
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "tensors": len(tensors),
    }


def lora_adapter(policy, rank: int) -> dict:
    """Adapter-only tensors of a peft LoRA on every projection (what named_weights pushes)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from unirl_lightning.weight_sync import named_weights

    model, _ = policy.build()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    return named_weights(peft_model)


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Both engines on the same requests and pushes (vLLM skipped when it is not installed); the record."""
    import torch

    from unirl_lightning.engines.hf import HFEngineConfig
    from unirl_lightning.models.causal_lm import PretrainedCausalLM, TinyCausalLM
    from unirl_lightning.weight_sync import named_weights

    if config["model"] == "smollm2":
        policy = PretrainedCausalLM("smollm2-135m-instruct", dtype="float32", chat=True)
        new_weights = named_weights(policy.build()[0])  # a full push of the model's own size
        description = {"name": "SmolLM2-135M-Instruct", "dtype": "float32", "chat": True}
    else:
        policy = TinyCausalLM(
            hidden_size=config["hidden_size"],
            num_layers=config["num_layers"],
            num_heads=config["num_heads"],
            intermediate_size=2 * config["hidden_size"],
            max_position_embeddings=max(64, config["max_new_tokens"] + 16),
        )
        new_weights = named_weights(TinyCausalLM(**{**policy.__dict__, "seed": 1}).build()[0])
        description = dict(policy.__dict__)
    threads = os.cpu_count() or 1
    record: dict = {
        "model": {**description, "parameters": sum(t.numel() for t in new_weights.values())},
        "workload": {
            "prompts": config["prompts"],
            "n": config["n"],
            "max_new_tokens": config["max_new_tokens"],
            "temperature": 1.0,
            "repeats": config["repeats"],
            "warmup": config["warmup"],
        },
        "threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }

    hf = HFEngineConfig(device="cpu", num_threads=threads).build(policy)
    record["hf"] = {**time_generation(hf, config), **time_pushes(hf, new_weights, config["pushes"])}
    del hf

    try:
        import vllm
    except ImportError as exc:
        record["vllm"] = {"skipped": f"vLLM is not installed ({exc}): run with .venv-vllm/bin/python"}
        return record
    from unirl_lightning.engines.vllm import VLLMEngineConfig
    from unirl_lightning.models.lora import LoraSpec

    start = time.perf_counter()
    engine = VLLMEngineConfig().build(policy)
    startup_s = time.perf_counter() - start
    record["vllm"] = {
        "version": vllm.__version__,
        "startup_s": startup_s,
        **time_generation(engine, config),
        **time_pushes(engine, new_weights, config["pushes"]),
    }
    engine.close()
    adapter = lora_adapter(policy, rank=8)
    engine = VLLMEngineConfig().build(policy, LoraSpec(rank=8, alpha=16.0))
    lora = time_pushes(engine, adapter, config["pushes"])
    lora_gen = time_generation(engine, config)  # generation with the adapter active
    record["vllm_lora"] = {
        "lora_push_ms_median": lora["push_ms_median"],
        "lora_push_ms_mean": lora["push_ms_mean"],
        "adapter_bytes": lora["bytes"],
        "adapter_tensors": lora["tensors"],
        "tokens_per_s_with_adapter": lora_gen["tokens_per_s"],
    }
    engine.close()
    record["speedup_vllm_over_hf"] = record["vllm"]["tokens_per_s"] / record["hf"]["tokens_per_s"]
    return record


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2", help="default smollm2")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per request (default 16)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="completion cap (default 32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed requests per engine (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed requests first (default 2)")
    parser.add_argument("--pushes", type=int, default=10, help="timed weight pushes (default 10)")
    parser.add_argument("--hidden-size", type=int, default=64, help="tiny Llama width (default 64)")
    parser.add_argument("--num-layers", type=int, default=2, help="tiny Llama depth (default 2)")
    parser.add_argument(
        "--num-heads", type=int, default=2, help="heads; vLLM's CPU attention needs head size >= 32"
    )
    config = common.parse_config(parser)
    set_environment()
    for name in (
        "prompts",
        "n",
        "max_new_tokens",
        "repeats",
        "pushes",
        "hidden_size",
        "num_layers",
        "num_heads",
    ):
        if config[name] < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {config[name]}")

    record = run(config)

    print(f"{'engine':<10} {'tokens/s':>10} {'s/request':>10} {'push ms':>9}")
    for name in ("hf", "vllm"):
        row = record[name]
        if "skipped" in row:
            print(f"{name:<10} skipped: {row['skipped']}")
            continue
        print(
            f"{name:<10} {row['tokens_per_s']:>10.0f} {row['s_per_request']:>10.3f} {row['push_ms_median']:>9.2f}"
        )
    if "vllm_lora" in record:
        print(
            f"{'vllm lora':<10} {record['vllm_lora']['tokens_per_s_with_adapter']:>10.0f} {'':>10} "
            f"{record['vllm_lora']['lora_push_ms_median']:>9.2f}"
        )
    common.finish(record, "engines", config=config)


if __name__ == "__main__":
    main()
