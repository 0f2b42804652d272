"""Weight-sync time and bytes with 1 vs 2 training ranks (DDP and FSDP2), object store vs collective.

Each configuration is a short synchronous GRPO run (``max_staleness=0``) in its own process: 1 rank
with ``AsyncRolloutStrategy``, or 2 ranks (gloo, CPU) with ``AsyncRolloutDDPStrategy`` (every rank
holds the weights) or ``AsyncRolloutFSDPStrategy`` (every rank holds half: a push gathers them
first, tensor by tensor for the object store, bucket by bucket for the collective), one
rollout worker per rank, on a small Llama (hidden 256, 4 layers, ~3.3M parameters, ~13 MB fp32) so
that the push is not all overhead. Every sync's ``sync/time_s`` (push, as rank 0 saw it) and
``sync/bytes`` (per rank) is recorded; the median over the steps after the first is reported.

Prints a table and a final JSON line, writes ``benchmarks/results/weight_sync_ranks.json``.

    python benchmarks/weight_sync_ranks.py [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_PATH = ROOT / "benchmarks" / "results" / "weight_sync_ranks.json"
LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS")


def child(config: dict) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    sys.path.insert(0, str(ROOT))
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything

    from tests.builders import tiny_module
    from unirl_lightning.callbacks import WeightSyncCallback, WeightVersionLogger
    from unirl_lightning.data import PromptDataModule
    from unirl_lightning.models import TinyCausalLM
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
    out = Path(config["out"]) / f"rank{trainer.global_rank}.json"
    out.write_text(json.dumps(syncs.syncs))


def run(config: dict) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
        env["RAY_AUTH_MODE"] = "token"
        command = [sys.executable, __file__, "--child", json.dumps({**config, "out": out})]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{config} failed:\n{done.stderr[-3000:]}")
        syncs = json.loads((Path(out) / "rank0.json").read_text())[1:]  # the first sync warms up
    return {
        **config,
        "sync_ms_median": 1e3 * statistics.median(s["sync/time_s"] for s in syncs),
        "sync_ms_max": 1e3 * max(s["sync/time_s"] for s in syncs),
        "bytes_per_rank": int(syncs[0]["sync/bytes"]),
        "bytes_total": int(syncs[0]["sync/bytes"]) * config["ranks"],
        "syncs": len(syncs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    configs = [(1, "single"), (2, "ddp"), (2, "fsdp")]
    rows = [
        run({"ranks": ranks, "parallel": parallel, "backend": backend, "steps": args.steps})
        for backend in ("object_store", "collective")
        for ranks, parallel in configs
    ]
    print(
        f"{'backend':<13} {'ranks':>5} {'parallel':>8} {'sync ms (median)':>17} {'MB per rank':>12} {'MB total':>9}"
    )
    for row in rows:
        print(
            f"{row['backend']:<13} {row['ranks']:>5} {row['parallel']:>8} {row['sync_ms_median']:>17.1f} "
            f"{row['bytes_per_rank'] / 1e6:>12.2f} {row['bytes_total'] / 1e6:>9.2f}"
        )
    record = {"rows": rows, "model": "TinyCausalLM(hidden 256, 4 layers)", "machine": "2 CPU cores"}
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
