"""The on-policy pin of SmolLM2-135M-Instruct in bf16 compute over float32 master weights, on CPU.

Synchronous GRPO steps (``max_staleness=0, max_inflight=1``) of full fine-tuning (no LoRA) on the chat
word problems: the policy is loaded in bf16, trains float32 masters under bf16 autocast and pushes bf16
weights to the HF engine after every step. With nothing stale the PPO ratio of the first mini-batch is
the engine's bf16 log-probs against the trainer's bf16-autocast recompute, so ``|ratio - 1|`` and the
log-prob gap are the precision tolerance of the pin (float32 runs pin the gap below 1e-4: tests of the
real model). The trainable parameters and AdamW's state must stay float32. 2 prompts x 2 samples x 16
tokens per step (bf16 matrix products are slow on CPU; the pin does not depend on the batch).

Measured over 3 steps on 2 CPU cores (docs/real_models.md): ``|ratio - 1|`` at most 6.0e-3, the
log-prob gap at most 0.034 per token; the bounds below leave room for other samples.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from tests.unit.real_model import needs_smollm2
from unirl_lightning import AsyncRolloutStrategy, GRPOModule, PromptDataModule
from unirl_lightning.models.causal_lm import PretrainedCausalLM
from unirl_lightning.rewards import MathVerifyReward

pytestmark = [pytest.mark.slow, needs_smollm2, pytest.mark.usefixtures("ray_local")]

STEPS = 2  # the first step's ratio is the pin itself; the second follows a bf16 push of the updated masters
MAX_ABS_RATIO_MINUS_1 = 0.02
MAX_LOGP_DIFF_ABS = 0.1


class PinRecorder(Callback):
    """Every step's pin figures and the dtypes of the trainable parameters and of AdamW's state."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        mine = pl_module.last_step_metrics
        optimizer = pl_module.optimizers().optimizer
        self.steps.append(
            {
                "ratio_mean": float(mine["ratio_mean"]),
                "logp_diff_abs": float(mine["logp_diff_abs"]),
                "trainable_dtypes": {p.dtype for p in pl_module.policy.parameters() if p.requires_grad},
                "optimizer_state_dtypes": {
                    v.dtype for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
                },
            }
        )


def test_bf16_compute_over_float32_masters_keeps_the_on_policy_pin():
    module = GRPOModule(
        policy=PretrainedCausalLM(name_or_path="smollm2-135m-instruct", dtype="bfloat16", chat=True),
        reward=MathVerifyReward(),
        num_generations=2,
        max_new_tokens=16,
        temperature=0.6,
        lr=1e-6,
    )
    data = PromptDataModule(
        train="word_problems", task_kwargs={"difficulty": "easy"}, batch_size=2, num_train_prompts=16
    )
    recorder = PinRecorder()
    strategy = AsyncRolloutStrategy(max_staleness=0, max_inflight=1)
    trainer = Trainer(
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    try:
        trainer.fit(module, datamodule=data)
    finally:
        strategy.shutdown()
    assert len(recorder.steps) == STEPS
    for step in recorder.steps:
        assert step["trainable_dtypes"] == {torch.float32}
        assert step["optimizer_state_dtypes"] == {torch.float32}
        assert abs(step["ratio_mean"] - 1) < MAX_ABS_RATIO_MINUS_1, step
        assert step["logp_diff_abs"] < MAX_LOGP_DIFF_ABS, step
