"""One AdamW step over SmolLM2-135M's parameters: torch's default implementation vs the fused kernel.

    python benchmarks/optimizer_step.py [--steps 5] [--threads 2] [--device cpu|cuda]

The parameters are SmolLM2-135M-Instruct's shapes (the tied 49152 x 576 embedding, 30 decoder layers
of q/k/v/o, gate/up/down and two norms, the final norm: 134.5M float32 parameters in 272 tensors),
random, each with a random gradient. Implementations, one optimizer each over its own copy, the steps
interleaved (one step of each in turn, after one warm-up step each, which allocates the moments):

* ``default``: ``torch.optim.AdamW(params)`` as torch picks it (on CPU a Python loop over the
  parameters, about ten tensor ops each; on CUDA the ``foreach`` kernels);
* ``foreach``: ``foreach=True``;
* ``fused``: ``fused=True`` (one kernel per parameter: param, grad and both moments in one pass),
  what :func:`unirl_lightning.modules.optim.adamw` picks where every parameter allows it, and what
  HF ``Trainer`` (so TRL) uses by default.

The three end at the same weights (the maximum absolute difference after the steps is reported).
Prints a table and a JSON line; writes ``benchmarks/results/optimizer_step.json``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import common

HIDDEN, INTERMEDIATE, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152


def smollm2_shapes() -> list[tuple[int, ...]]:
    layer = [
        (HIDDEN, HIDDEN),  # q_proj
        (KV, HIDDEN),  # k_proj
        (KV, HIDDEN),  # v_proj
        (HIDDEN, HIDDEN),  # o_proj
        (INTERMEDIATE, HIDDEN),  # gate_proj
        (INTERMEDIATE, HIDDEN),  # up_proj
        (HIDDEN, INTERMEDIATE),  # down_proj
        (HIDDEN,),  # input_layernorm
        (HIDDEN,),  # post_attention_layernorm
    ]
    return [(VOCAB, HIDDEN), *layer * LAYERS, (HIDDEN,)]


def run(config: dict[str, Any]) -> dict[str, Any]:
    """The three implementations, steps interleaved; the results record."""
    import torch

    torch.set_num_threads(config["threads"])
    device = torch.device(config["device"])
    generator = torch.Generator().manual_seed(0)
    shapes = smollm2_shapes()
    start = [torch.randn(s, generator=generator) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=generator) * 1e-3 for s in shapes]
    kinds = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    optimizers: dict[str, torch.optim.Optimizer] = {}
    params: dict[str, list[torch.nn.Parameter]] = {}
    for name, kwargs in kinds.items():
        params[name] = [torch.nn.Parameter(t.to(device)) for t in start]
        for p, g in zip(params[name], grads):
            p.grad = g.to(device)
        optimizers[name] = torch.optim.AdamW(params[name], lr=1e-4, weight_decay=0.01, **kwargs)

    def step(name: str) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        optimizers[name].step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for name in kinds:  # warm-up: allocates the moments
        step(name)
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(config["steps"]):
        for name in kinds:
            times[name].append(step(name))
    reference = params["default"]
    rows = {
        name: {
            "median_s": round(statistics.median(ts), 4),
            "min_s": round(min(ts), 4),
            "max_s": round(max(ts), 4),
            "max_abs_diff_vs_default": max(
                float((a.detach() - b.detach()).abs().max()) for a, b in zip(params[name], reference)
            ),
        }
        for name, ts in times.items()
    }
    results = {
        "machine": common.machine(),
        "device": str(device),
        "threads": config["threads"],
        "parameters": sum(t.numel() for t in start),
        "tensors": len(start),
        "steps": config["steps"],
        "implementations": rows,
        "fused_speedup_vs_default": round(rows["default"]["median_s"] / rows["fused"]["median_s"], 2),
    }
    return results


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default=str(common.results_path("optimizer_step")))
    config = common.parse_config(parser)
    results = run(config)
    for name, row in results["implementations"].items():
        print(
            f"{name:<8} {row['median_s']:.3f} s  [{row['min_s']:.3f}-{row['max_s']:.3f}]  "
            f"max |diff| vs default {row['max_abs_diff_vs_default']:.2e}"
        )
    common.finish(results, config["out"], {k: v for k, v in results.items() if k != "machine"}, indent=1)


if __name__ == "__main__":
    main()
