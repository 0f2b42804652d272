"""Flow-GRPO throughput on the tiny flow-matching model: trained images per second, sync vs async.

Both runs are the same ``Trainer(strategy=AsyncRolloutStrategy(...)).fit(FlowGRPOModule(...))`` on real
Ray workers, differing only in the staleness budget:

* sync: ``max_staleness=0, max_inflight=1``: generate, then train, then push (nothing overlaps);
* async: ``max_staleness=1, max_inflight=1``: the poll-first loop launches the next request as soon as
  the previous result is reaped, so it generates while this step trains.

The clock runs from the start of step ``--warmup`` to the end of training (worker start-up, model
pre-training and the first steps are excluded); images = steps timed x prompts x images per prompt.
The trainer and each worker use one torch thread. Prints one line per run and, as the last line, a
JSON record that is also written to ``benchmarks/results/flow_grpo_throughput.json``.

Usage::

    python -m benchmarks.performance.flow_grpo_throughput [--steps 20] [--warmup 3] [--num-steps 10]
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from benchmarks.harness import common
from unirl_lightning.callbacks import SampleImageLogger, WeightSyncCallback, WeightVersionLogger
from unirl_lightning.data import ImagePromptDataModule
from unirl_lightning.models.diffusion import TinyFlowModel
from unirl_lightning.modules import FlowGRPOModule
from unirl_lightning.strategy import AsyncRolloutStrategy

PERF_TAGS = ("perf/generate_time_s", "perf/train_time_s", "sync/quiesce_s")


class StepClock(Callback):
    """Wall time from the start of step ``warmup`` to the end of training, and the per-step perf metrics."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: float | None = None
        self.end: float | None = None
        self.steps = 0
        self.perf: dict[str, float] = dict.fromkeys(PERF_TAGS, 0.0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.warmup:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.start is not None:
            self.steps += 1
            self.end = time.perf_counter()  # after this step's sync (the sync callback runs first)
            for tag in PERF_TAGS:
                self.perf[tag] += float(pl_module.last_logged_metrics.get(tag, 0.0))


def run_mode(config: dict[str, Any], policy: TinyFlowModel, max_staleness: int) -> dict[str, float]:
    """One fit at ``max_staleness`` (0: sync, 1: async); images/s over the timed steps."""
    seed_everything(0)
    clock = StepClock(config["warmup"])
    strategy = AsyncRolloutStrategy(max_staleness=max_staleness, max_inflight=1)
    trainer = Trainer(
        strategy=strategy,
        max_steps=config["steps"],
        callbacks=[WeightSyncCallback(), WeightVersionLogger(), clock, SampleImageLogger(num_images=0)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    module = FlowGRPOModule(
        policy=policy,
        num_generations=config["num_generations"],
        num_steps=config["num_steps"],
        timestep_fraction=config["timestep_fraction"],
        lr=1e-3,
        clip_range=1e-3,
    )
    try:
        trainer.fit(module, datamodule=ImagePromptDataModule(batch_size=config["batch_size"]))
    finally:
        strategy.shutdown()
    images = clock.steps * config["batch_size"] * config["num_generations"]
    wall_s = clock.end - clock.start
    per_step = {
        tag.split("/")[1].removesuffix("_s") + "_s_per_step": v / clock.steps for tag, v in clock.perf.items()
    }
    return {"images_per_s": images / wall_s, "wall_s": wall_s, "steps": clock.steps, **per_step}


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Sync then async on the same pre-trained model, one torch thread; the record."""
    torch.set_num_threads(1)
    policy = TinyFlowModel(pretrain_steps=config["pretrain_steps"], cache_dir=config["cache_dir"])
    policy.build()  # pre-train (or load) once, outside the clock
    results = {}
    for name, max_staleness in (("sync", 0), ("async", 1)):
        results[name] = result = run_mode(config, policy, max_staleness)
        print(
            f"{name:>5}: {result['images_per_s']:7.1f} images/s ({result['steps']} steps in {result['wall_s']:.1f} s; "
            f"per step: generate {result['generate_time_s_per_step']:.2f} s, train {result['train_time_s_per_step']:.2f} s, "
            f"sync waited {result['quiesce_s_per_step']:.2f} s)"
        )
    return {
        "sync_images_per_s": round(results["sync"]["images_per_s"], 2),
        "async_images_per_s": round(results["async"]["images_per_s"], 2),
        "speedup": round(results["async"]["images_per_s"] / results["sync"]["images_per_s"], 3),
        "steps_timed": results["sync"]["steps"],
        "generate_s_per_step": round(results["sync"]["generate_time_s_per_step"], 3),
        "train_s_per_step": round(results["sync"]["train_time_s_per_step"], 3),
        "images_per_step": config["batch_size"] * config["num_generations"],
        "num_steps": config["num_steps"],
        "timestep_fraction": config["timestep_fraction"],
        "model": "TinyFlowModel(arch='sd3', image_size=8)",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def main() -> dict:
    parser = common.script_parser(__doc__)
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the clock starts")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per step")
    parser.add_argument("--num-generations", type=int, default=8, help="images per prompt")
    parser.add_argument("--num-steps", type=int, default=10, help="denoising steps per image")
    parser.add_argument("--timestep-fraction", type=float, default=0.5, help="SDE steps trained per step")
    parser.add_argument("--pretrain-steps", type=int, default=100, help="the model's pre-training (cached)")
    parser.add_argument(
        "--cache-dir", default=os.path.join(tempfile.gettempdir(), "unirl_lightning", "bench")
    )
    config = common.parse_config(parser)
    if config["warmup"] >= config["steps"]:
        parser.error(f"--warmup ({config['warmup']}) must be below --steps ({config['steps']})")
    record = run(config)
    common.finish(record, "flow_grpo_throughput", config=config)
    return record


if __name__ == "__main__":
    main()
