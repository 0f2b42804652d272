"""Weight-sync time and bytes with 1 vs 2 training ranks (DDP and FSDP2), object store vs collective.

Each configuration is a short synchronous GRPO run (``max_staleness=0``) in its own process: 1 rank
with ``AsyncRolloutStrategy``, or 2 ranks (gloo, CPU) with ``AsyncRolloutDDPStrategy`` (every rank
holds the weights) or ``AsyncRolloutFSDPStrategy`` (every rank holds half: a push gathers them
first, tensor by tensor for the object store, bucket by bucket for the collective), one
rollout worker per rank, on a small Llama (hidden 256, 4 layers, ~3.3M parameters, ~13 MB fp32) so
that the push is not all overhead. Every sync's ``sync/time_s`` (push, as rank 0 saw it) and
``sync/bytes`` (per rank) is recorded; the median over the steps after the first is reported.

Prints a table and a final JSON line, writes ``benchmarks/results/weight_sync_ranks.json``.

    python -m benchmarks.performance.weight_sync_ranks [--steps 12] [--backends ...] [--parallel single ddp fsdp]
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.harness import common

CONFIGS = [(1, "single"), (2, "ddp"), (2, "fsdp")]  # (ranks, parallel)


def child(config: dict) -> dict[str, Any] | None:
    """One configuration's fit (with 2 ranks Lightning re-runs this command for rank 1); rank 0's
    syncs (the other ranks return None: only rank 0 prints the result)."""
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything

    from tests.builders import tiny_module
    from unirl_lightning.callbacks import WeightSyncCallback, WeightVersionLogger
    from unirl_lightning.data import PromptDataModule
    from unirl_lightning.models.causal_lm import TinyCausalLM
    from unirl_lightning.strategy import (
        AsyncRolloutDDPStrategy,
        AsyncRolloutFSDPStrategy,
        AsyncRolloutStrategy,
    )

    class Syncs(Callback):
        def __init__(self) -> None:
            self.syncs: list[dict] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.syncs.append(dict(trainer.strategy.last_sync))

    torch.set_num_threads(1)
    seed_everything(0)
    rollout = dict(max_staleness=0, max_inflight=1, num_workers=1, weight_sync=config["backend"])
    ranks = config["ranks"]
    parallel = {"single": None, "ddp": AsyncRolloutDDPStrategy, "fsdp": AsyncRolloutFSDPStrategy}[
        config["parallel"]
    ]
    strategy = (
        AsyncRolloutStrategy(**rollout) if ranks == 1 else parallel(process_group_backend="gloo", **rollout)
    )
    syncs = Syncs()
    trainer = Trainer(
        accelerator="cpu",
        devices=ranks,
        strategy=strategy,
        max_steps=config["steps"],
        callbacks=[WeightSyncCallback(), WeightVersionLogger(histogram_every_n_steps=0), syncs],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    policy = TinyCausalLM(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=512)
    module = tiny_module(policy=policy, num_generations=4, max_new_tokens=2)
    data = PromptDataModule(
        "digit_successor", batch_size=4, num_train_prompts=256, task_kwargs={"prefix_len": 2}
    )
    trainer.fit(module, datamodule=data)
    return {"syncs": syncs.syncs} if trainer.global_rank == 0 else None


def run_one(config: dict) -> dict:
    """One configuration in a fresh process: rank 0's sync time and bytes."""
    name = f"{config['backend']}-{config['ranks']}-{config['parallel']}"
    syncs = common.run_child(Path(__file__), {**config, "name": name})["syncs"][1:]  # the first warms up
    return {
        **config,
        "sync_ms_median": 1e3 * statistics.median(s["sync/time_s"] for s in syncs),
        "sync_ms_max": 1e3 * max(s["sync/time_s"] for s in syncs),
        "bytes_per_rank": int(syncs[0]["sync/bytes"]),
        "bytes_total": int(syncs[0]["sync/bytes"]) * config["ranks"],
        "syncs": len(syncs),
    }


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Every backend x (1 rank, 2 DDP ranks, 2 FSDP ranks); the record."""
    rows = [
        run_one({"ranks": ranks, "parallel": parallel, "backend": backend, "steps": config["steps"]})
        for backend in config["backends"]
        for ranks, parallel in CONFIGS
        if parallel in config["parallel"]
    ]
    return {"rows": rows, "model": "TinyCausalLM(hidden 256, 4 layers)", "machine": "2 CPU cores"}


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--backends",
        nargs="+",
        choices=["object_store", "collective"],
        default=["object_store", "collective"],
    )
    parser.add_argument(
        "--parallel", nargs="+", choices=[p for _, p in CONFIGS], default=[p for _, p in CONFIGS]
    )
    config = common.parse_config(parser, child=child)
    record = run(config)
    print(
        f"{'backend':<13} {'ranks':>5} {'parallel':>8} {'sync ms (median)':>17} {'MB per rank':>12} {'MB total':>9}"
    )
    for row in record["rows"]:
        print(
            f"{row['backend']:<13} {row['ranks']:>5} {row['parallel']:>8} {row['sync_ms_median']:>17.1f} "
            f"{row['bytes_per_rank'] / 1e6:>12.2f} {row['bytes_total'] / 1e6:>9.2f}"
        )
    common.finish(record, "weight_sync_ranks", config=config)


if __name__ == "__main__":
    main()
