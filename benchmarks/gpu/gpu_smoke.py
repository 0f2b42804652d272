"""GPU smoke check of precision and memory: one process, one CUDA device, one JSON report.

Checks, each recorded under ``checks`` with ``ok``, its figures and its seconds (a failing check
records its error and the next one still runs):

* ``mixed_precision``: a GRPO module on a bf16 policy keeps float32 masters (and a fused AdamW
  with float32 state), a bf16 frozen reference, computes bf16 logits under autocast on CUDA, and one step at
  lr 1e-6 moves the masters with a gradient (few of them move once rounded to bf16: what pure bf16
  weights lost).
* ``logprob_memory``: peak ``torch.cuda.max_memory_allocated`` of a log-prob forward + backward
  from bf16 logits at vocabulary 151936, chunked (``token_logprobs``) vs the former row loop.
* ``hf_generate``: the HF engine on CUDA generating with behaviour log-probs (peak memory and time,
  scored step by step vs the former kept ``output_logits``; the two must give the same log-probs).
* ``weight_push``: CUDA float32 masters packed as the object-store push packs them (cast to bf16
  tensor by tensor) and loaded into that engine: bit-equal to the masters rounded to bf16; the
  collective layout is all bf16.
* ``on_policy_pin``: the engine's bf16 behaviour log-probs vs the trainer's (bf16 autocast over the
  pushed float32 masters) on the engine's own samples: max / mean abs gap (and the gap of a plain
  bf16 full forward of the engine's model, which isolates what KV-cache decoding alone gives).
* ``fsdp2_fit``: one Lightning ``Trainer.fit`` step with ``ModelParallelStrategy`` (FSDP2, 1 rank,
  NCCL) of the same module on pre-collated batches: float32 ``DTensor`` masters, bf16
  ``MixedPrecisionPolicy``, the step runs and moves the weights.
* ``hybrid_fit``: a whole ``unirl-lightning fit --config examples/grpo_tiny_hybrid.yaml`` (the engine
  in this process, no Ray) on the device, the policy in bf16 over float32 masters, ``precision:
  32-true`` (fused AdamW): the sampled reward of its last 20 steps must be at least twice its first 20 steps' (held-out accuracy is recorded), and the on-policy pin hold
  within bf16's tolerance (|ratio - 1| and the log-prob gap < 0.05 at every step).
* ``real_size``: a random-init model of ``examples/model_configs/Qwen2.5-0.5B-Instruct/config.json``
  (no weights): HF generation tokens/s (64 rows, 256 + 256 tokens), a training step's tokens/s
  (fwd+bwd+AdamW, micro-batches of 8192 tokens, activation checkpointing), and peak memory next to
  ``unirl-lightning plan``'s estimate of the same settings.

No Ray cluster, math-verify (but in ``hybrid_fit``'s reward), diffusers or vLLM is used; the report
lists which of ``ray``, ``jsonargparse``, ``math_verify``, ``diffusers``, ``vllm`` got imported and
whether Ray was started (a machine without Ray runs it: docs/gpus.md). The whole run should take under
5 minutes on one H200 (a deadline skips what is left after 4.5 minutes); Without CUDA (and without ``--cpu``) it prints one line saying so and exits 3, so
``make gpu-smoke`` never passes empty; ``--cpu`` runs the same checks on
CPU at small sizes (FSDP2 over gloo), to check the script itself.

The checks are in ``gpu_checks_train.py`` (``mixed_precision``, ``fsdp2_fit``),
``gpu_checks_memory.py`` (``logprob_memory``) and ``gpu_checks_engine.py`` (``hf_generate``,
``weight_push``, ``on_policy_pin``).

    python -m benchmarks.gpu.gpu_smoke [--out benchmarks/results/gpu_smoke.json] [--cpu] [--checks NAME ...]
    make gpu-smoke
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

from benchmarks.gpu.gpu_checks_engine import check_hf_generate, check_on_policy_pin, check_weight_push
from benchmarks.gpu.gpu_checks_fit import check_hybrid_fit, check_real_size
from benchmarks.gpu.gpu_checks_memory import check_logprob_memory
from benchmarks.gpu.gpu_checks_train import check_fsdp2_fit, check_mixed_precision
from benchmarks.harness import common

DEADLINE_S = 270
NO_CUDA = (
    "gpu_smoke: no CUDA device (torch.cuda.is_available() is False): nothing checked; "
    "--cpu runs the dry run on CPU"
)


class Smoke:
    """Runs named checks, records each (figures, ok, seconds, error), skips them past the deadline."""

    def __init__(self, device: Any, sizes: dict[str, int], only: list[str] | None = None) -> None:
        self.device = device
        self.only = only
        self.sizes = sizes
        self.start = time.perf_counter()
        self.checks: dict[str, dict[str, Any]] = {}

    def run(self, name: str, fn, *args: Any) -> Any:
        if self.only and name not in self.only:
            return None
        if time.perf_counter() - self.start > DEADLINE_S:
            self.checks[name] = {"ok": False, "skipped": f"past the {DEADLINE_S} s deadline"}
            return None
        began = time.perf_counter()
        record: dict[str, Any] = {}
        try:
            value = fn(record, *args)
            record.setdefault("ok", True)
        except Exception as exc:  # noqa: BLE001 - a smoke check reports every failure and goes on
            value = None
            record.update(
                ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:]
            )
        record["seconds"] = round(time.perf_counter() - began, 3)
        self.checks[name] = record
        print(f"{name}: {'ok' if record['ok'] else 'FAILED'} ({record['seconds']} s)", flush=True)
        return value


CHECKS = [
    "mixed_precision",
    "logprob_memory",
    "hf_generate",
    "weight_push",
    "on_policy_pin",
    "fsdp2_fit",
    "hybrid_fit",
    "real_size",
]
GPU_SIZES = dict(
    vocab=151936,
    hidden=256,
    layers=2,
    new_tokens=64,
    rows=64,
    memory_vocab=151936,
    memory_batch=8,
    memory_length=1024,
)
CPU_SIZES = dict(
    vocab=2048, hidden=32, layers=1, new_tokens=8, rows=6, memory_vocab=4096, memory_batch=2, memory_length=32
)


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Every check on CUDA device 0 (``config["cpu"]``: on CPU at small sizes); the report (``ok``:
    every check passed), or ``{"skipped": ...}`` without CUDA."""
    import torch

    if not torch.cuda.is_available() and not config["cpu"]:
        return {"skipped": NO_CUDA}
    import warnings

    warnings.filterwarnings("ignore")
    device = torch.device("cpu") if config["cpu"] else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    smoke = Smoke(device, CPU_SIZES if config["cpu"] else GPU_SIZES, config.get("checks"))
    module = smoke.run("mixed_precision", check_mixed_precision, smoke)
    smoke.run("logprob_memory", check_logprob_memory, smoke)
    generated = smoke.run("hf_generate", check_hf_generate, smoke)
    if module is not None and generated is not None:
        engine, prompts, sampling = generated
        smoke.run("weight_push", check_weight_push, smoke, module, engine)
        smoke.run("on_policy_pin", check_on_policy_pin, smoke, module, engine, prompts, sampling)
        del engine
    del module, generated
    if device.type == "cuda":
        torch.cuda.empty_cache()
    smoke.run("fsdp2_fit", check_fsdp2_fit, smoke)
    smoke.run("hybrid_fit", check_hybrid_fit, smoke)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    smoke.run("real_size", check_real_size, smoke)

    ray = sys.modules.get("ray")
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "sizes": smoke.sizes,
        "ok": all(c.get("ok") for c in smoke.checks.values()),
        "seconds": round(time.perf_counter() - smoke.start, 1),
        "imported": sorted(
            m
            for m in ("ray", "jsonargparse", "math_verify", "diffusers", "vllm")
            if sys.modules.get(m) is not None
        ),
        "ray_initialized": bool(ray is not None and ray.is_initialized()),
        "checks": smoke.checks,
    }


def main(argv: list[str] | None = None) -> int:
    parser = common.script_parser(__doc__)
    parser.add_argument(
        "--out", default="gpu_smoke", help="the JSON report (a bare name: in the results folder)"
    )
    parser.add_argument("--cpu", action="store_true", help="run the checks on CPU at small sizes (a dry run)")
    parser.add_argument("--checks", nargs="+", choices=CHECKS, help="run these checks only (default: all)")
    config = common.parse_config(parser, argv)
    report = run(config)
    if "skipped" in report:
        print(report["skipped"], file=sys.stderr)
        return 3  # never a pass: `make gpu-smoke` on a machine whose GPU is hidden fails
    out = common.write_results(report, config["out"], config=config)
    print(json.dumps({k: v for k, v in report.items() if k != "checks"}))
    print(f"wrote {out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
