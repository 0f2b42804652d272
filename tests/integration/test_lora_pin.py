"""The LoRA on-policy pin in the real loop: the SmolLM2 recipe (``examples/grpo_smollm2_cpu.yaml``:
LoRA rank 16, lr 4e-4, 2 prompts x 8 samples x 64 tokens at temperature 0.6) run synchronously
(``max_staleness=0, max_inflight=1``) for 18 steps with the HF engine. At every step the engine must
serve exactly the adapters the trainer holds: ``train/ratio_mean`` within 1e-3 of 1 and the rollout vs
trainer log-prob gap (``train/logp_diff_abs``) below 1e-4. The module and data come from the parsed
recipe; the trainer is built here (no evaluation, logging or checkpoints).

Writes ``benchmarks/results/lora_pin.json`` and prints one line per step (~6-8 min on 2 cores).

    python benchmarks/lora_pin.py [--steps 18]
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

import common

RECIPE = common.REPO / "examples" / "grpo_smollm2_cpu.yaml"


def run(config: dict[str, Any]) -> dict[str, Any]:
    """``config["steps"]`` synchronous steps of the recipe; the per-step pin figures and their maxima."""
    common.quiet()
    from lightning.pytorch import Callback, Trainer

    from unirl_lightning import AsyncRolloutStrategy
    from unirl_lightning.cli.app import UniRLCLI

    steps: list[dict] = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            mine = pl_module.last_step_metrics
            steps.append(
                {
                    "step": len(steps) + 1,
                    "ratio_mean": float(mine["ratio_mean"]),
                    "logp_diff_abs": float(mine["logp_diff_abs"]),
                    "reward_mean": float(batch.rewards.mean()),
                }
            )
            print(json.dumps(steps[-1]), flush=True)

    with tempfile.TemporaryDirectory(prefix="lora-pin-") as folder:
        os.chdir(folder)  # the parsed recipe's logger folder lands here, unused
        cli = UniRLCLI(args=["--config", str(RECIPE)], run=False)
        trainer = Trainer(
            strategy=AsyncRolloutStrategy(max_staleness=0, max_inflight=1),
            max_steps=config["steps"],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            callbacks=[Record()],
        )
        start = time.perf_counter()
        trainer.fit(cli.model, datamodule=cli.datamodule)
        trainer.strategy.shutdown()
    return common.pin_result(steps, time.perf_counter() - start)


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--steps", type=int, default=18)
    result = run(common.parse_config(parser))
    common.finish(result, "lora_pin", {k: v for k, v in result.items() if k not in ("steps", "machine")})


if __name__ == "__main__":
    main()
