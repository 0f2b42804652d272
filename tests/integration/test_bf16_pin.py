"""The on-policy pin of SmolLM2-135M-Instruct in bf16 with float32 master weights, on CPU.

A few synchronous GRPO steps (``max_staleness=0, max_inflight=1``) of full fine-tuning (no LoRA) on
the chat word problems: the policy is loaded in bf16, trains float32 masters under bf16 autocast, and
pushes bf16 weights to the HF engine after every step. With nothing stale, the PPO ratio of the first
mini-batch is the engine's bf16 log-probs against the trainer's bf16-autocast recompute, so
``|ratio - 1|`` and the log-prob gap are the precision tolerance of the pin (fp32 runs pin the gap
below 1e-4). Also checks that the trainable parameters and AdamW's state are float32.

Writes ``benchmarks/results/bf16_pin.json`` and prints one line per step.

    python benchmarks/bf16_pin.py [--steps 3]
"""

from __future__ import annotations

import json
import time
from typing import Any

import common


def run(config: dict[str, Any]) -> dict[str, Any]:
    """``config["steps"]`` synchronous bf16 steps; the per-step pin figures and their maxima."""
    common.quiet()
    import torch
    from lightning.pytorch import Callback, Trainer

    from unirl_lightning import AsyncRolloutStrategy, GRPOModule, PromptDataModule
    from unirl_lightning.models.causal_lm import PretrainedCausalLM
    from unirl_lightning.rewards import MathVerifyReward

    steps: list[dict] = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            mine = pl_module.last_step_metrics
            optimizer = pl_module.optimizers().optimizer
            state_dtypes = {
                str(v.dtype) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
            }
            steps.append(
                {
                    "step": len(steps),
                    "ratio_mean": float(mine["ratio_mean"]),
                    "ratio_dev_max": float(mine.get("ratio_dev_max", float("nan"))),
                    "logp_diff_abs": float(mine["logp_diff_abs"]),
                    "trainable_dtypes": sorted(
                        {str(p.dtype) for p in pl_module.policy.parameters() if p.requires_grad}
                    ),
                    "optimizer_state_dtypes": sorted(state_dtypes),
                }
            )
            print(json.dumps(steps[-1]), flush=True)

    module = GRPOModule(
        policy=PretrainedCausalLM(name_or_path="smollm2-135m-instruct", dtype="bfloat16", chat=True),
        reward=MathVerifyReward(),
        num_generations=4,
        max_new_tokens=32,
        temperature=0.6,
        lr=1e-6,
    )
    data = PromptDataModule(train="word_problems", task_kwargs={"difficulty": "easy"}, batch_size=2)
    trainer = Trainer(
        strategy=AsyncRolloutStrategy(max_staleness=0, max_inflight=1),
        max_steps=config["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[Record()],
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    trainer.strategy.shutdown()
    return common.pin_result(steps, time.perf_counter() - start)


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--steps", type=int, default=3)
    result = run(common.parse_config(parser))
    common.finish(result, "bf16_pin", {k: v for k, v in result.items() if k not in ("steps", "machine")})


if __name__ == "__main__":
    main()
