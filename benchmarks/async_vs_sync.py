"""Async vs synchronous GRPO on the tiny model, same steps, one process each, same machine.

    python benchmarks/async_vs_sync.py [--steps 30] [--hidden 64] [--layers 4] [--max-new-tokens 16]

Synchronous = ``max_staleness=0, max_inflight=1`` (generate, then train, then sync); async =
``max_staleness=1, max_inflight=2`` (the next batch generates while this one trains). The trainer
and the rollout worker each get one torch thread, so on 2 cores the ideal speedup is
``(generate + train) / max(generate, train)`` <= 2. Steps/s is measured from the end of the
warm-up steps to the end of the run (Ray and model start-up excluded). Prints a table and a final
JSON line; writes benchmarks/results/async_vs_sync.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from unirl_lightning import AsyncRolloutStrategy, GRPOModule, PromptDataModule, TinyCausalLM
from unirl_lightning.callbacks import WeightSyncCallback
from unirl_lightning.rewards import ExactMatchReward


class Clock(Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = None
        self.end = None
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.warmup:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.end = time.perf_counter()
        if batch_idx >= self.warmup:
            self.metrics.append(
                {
                    **{k: float(v) for k, v in trainer.callback_metrics.items()},
                    **pl_module.last_logged_metrics,
                }
            )


def run(mode: str, args: argparse.Namespace) -> dict[str, float]:
    seed_everything(0)
    staleness, inflight = (0, 1) if mode == "sync" else (1, 2)
    clock = Clock(args.warmup)
    strategy = AsyncRolloutStrategy(max_staleness=staleness, max_inflight=inflight)
    module = GRPOModule(
        policy=TinyCausalLM(
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=4,
            intermediate_size=2 * args.hidden,
            max_position_embeddings=128,
        ),
        reward=ExactMatchReward(),
        num_generations=args.group,
        max_new_tokens=args.max_new_tokens,
        lr=1e-3,
    )
    trainer = Trainer(
        strategy=strategy,
        max_steps=args.steps + args.warmup,
        callbacks=[WeightSyncCallback(), clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    data = PromptDataModule(train="digit_successor", batch_size=args.batch, task_kwargs={"prefix_len": 8})
    trainer.fit(module, datamodule=data)
    strategy.shutdown()
    steps = len(clock.metrics)

    def mean(key: str) -> float:
        return sum(m.get(key, 0.0) for m in clock.metrics) / steps

    return {
        "steps": steps,
        "steps_per_s": steps / (clock.end - clock.start),
        "generate_s": mean("perf/generate_time_s"),
        "train_s": mean("perf/train_time_s"),
        "sync_s": mean("sync/time_s"),
        "wait_s": mean("perf/wait_time_s"),
        "overlap": mean("perf/overlap"),
        "max_staleness_seen": max(m.get("rollout/staleness_max", 0.0) for m in clock.metrics),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "async_vs_sync.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {mode: run(mode, args) for mode in ("sync", "async")}
    header = f"{'mode':<6} {'steps/s':>8} {'generate s':>11} {'train s':>8} {'sync s':>7} {'wait s':>7} {'overlap':>8}"
    print(header)
    for mode, r in results.items():
        print(
            f"{mode:<6} {r['steps_per_s']:>8.3f} {r['generate_s']:>11.3f} {r['train_s']:>8.3f} {r['sync_s']:>7.3f} "
            f"{r['wait_s']:>7.3f} {r['overlap']:>8.2f}"
        )
    summary = {
        "sync_steps_per_s": round(results["sync"]["steps_per_s"], 4),
        "async_steps_per_s": round(results["async"]["steps_per_s"], 4),
        "speedup": round(results["async"]["steps_per_s"] / results["sync"]["steps_per_s"], 3),
        "overlap": round(results["async"]["overlap"], 3),
        "generate_s": round(results["async"]["generate_s"], 4),
        "train_s": round(results["async"]["train_s"], 4),
        "steps": args.steps,
        "config": vars(args) | {"out": None},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "runs": results}, indent=2) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
