"""Async vs synchronous GRPO on the tiny model, same steps, one process each, same machine.

    python -m benchmarks.performance.async_vs_sync [--steps 30] [--hidden 64] [--layers 4] [--max-new-tokens 16]

Synchronous = ``max_staleness=0, max_inflight=1`` (generate, then train, then sync); async =
``max_staleness=1, max_inflight=2`` (the next batch generates while this one trains). The trainer
and the rollout worker each get one torch thread, so on 2 cores the ideal speedup is
``(generate + train) / max(generate, train)`` <= 2. Steps/s is measured from the end of the
warm-up steps to the end of the run (Ray and model start-up excluded). Prints a table and a final
JSON line; writes benchmarks/results/async_vs_sync.json.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from benchmarks.harness import common
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


def run_mode(mode: str, config: dict[str, Any]) -> dict[str, float]:
    """One fit of ``config["steps"]`` timed steps, ``sync`` or ``async``."""
    seed_everything(0)
    staleness, inflight = (0, 1) if mode == "sync" else (1, 2)
    clock = Clock(config["warmup"])
    strategy = AsyncRolloutStrategy(max_staleness=staleness, max_inflight=inflight)
    module = GRPOModule(
        policy=TinyCausalLM(
            hidden_size=config["hidden"],
            num_layers=config["layers"],
            num_heads=4,
            intermediate_size=2 * config["hidden"],
            max_position_embeddings=128,
        ),
        reward=ExactMatchReward(),
        num_generations=config["group"],
        max_new_tokens=config["max_new_tokens"],
        lr=1e-3,
    )
    trainer = Trainer(
        strategy=strategy,
        max_steps=config["steps"] + config["warmup"],
        callbacks=[WeightSyncCallback(), clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    data = PromptDataModule(
        train="digit_successor", batch_size=config["batch"], task_kwargs={"prefix_len": 8}
    )
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


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Sync then async on one torch thread; the summary (speedup, overlap) and both runs."""
    torch.set_num_threads(1)
    results = {mode: run_mode(mode, config) for mode in ("sync", "async")}
    summary = {
        "sync_steps_per_s": round(results["sync"]["steps_per_s"], 4),
        "async_steps_per_s": round(results["async"]["steps_per_s"], 4),
        "speedup": round(results["async"]["steps_per_s"] / results["sync"]["steps_per_s"], 3),
        "overlap": round(results["async"]["overlap"], 3),
        "generate_s": round(results["async"]["generate_s"], 4),
        "train_s": round(results["async"]["train_s"], 4),
        "steps": config["steps"],
        "config": config | {"out": None},
    }
    return {"summary": summary, "runs": results}


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument(
        "--out", default="async_vs_sync", help="results file (a bare name: in the results folder)"
    )
    config = common.parse_config(parser)
    record = run(config)
    header = f"{'mode':<6} {'steps/s':>8} {'generate s':>11} {'train s':>8} {'sync s':>7} {'wait s':>7} {'overlap':>8}"
    print(header)
    for mode, r in record["runs"].items():
        print(
            f"{mode:<6} {r['steps_per_s']:>8.3f} {r['generate_s']:>11.3f} {r['train_s']:>8.3f} {r['sync_s']:>7.3f} "
            f"{r['wait_s']:>7.3f} {r['overlap']:>8.2f}"
        )
    common.finish(record, config["out"], record["summary"], config=config)


if __name__ == "__main__":
    main()
