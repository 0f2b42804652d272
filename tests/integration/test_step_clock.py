"""One step clock: with ``ppo_epochs: 2`` and ``mini_batches: 2`` (4 optimizer steps per RL step),
``trainer.max_steps``, ``trainer.global_step``, ``ModelCheckpoint(every_n_train_steps)``, the
callbacks' ``every_n_steps``, the TensorBoard x-axis, the progress bar and ``warmup_steps`` all count
RL steps, while the optimizer (and its learning-rate schedule) steps 4 times per RL step."""

from __future__ import annotations

import math

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from tests.builders import StepRecorder, tiny_module
from unirl_lightning.callbacks import RLProgressBar
from unirl_lightning.cli.curves import read_scalars
from unirl_lightning.data import PromptDataModule
from unirl_lightning.modules.schedule import lr_factor
from unirl_lightning.strategy import AsyncRolloutStrategy


class BarPosition(Callback):
    """The progress bar's (position, total) after every training batch (after the bar's own hook)."""

    def __init__(self, bar: RLProgressBar) -> None:
        self.bar, self.positions = bar, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.positions.append((self.bar.train_progress_bar.n, self.bar.train_progress_bar.total))


def test_every_visible_step_counts_rl_steps_with_four_optimizer_steps_each(tmp_path):
    steps, per_step, warmup, lr = 4, 4, 1, 1e-3
    module = tiny_module(ppo_epochs=2, mini_batches=2, lr=lr, lr_schedule="linear", warmup_steps=warmup)
    assert module.optimizer_steps_per_batch == per_step
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    strategy = AsyncRolloutStrategy(max_staleness=1, max_inflight=2, max_worker_restarts=0)
    bar, recorder = RLProgressBar(), StepRecorder()
    seen = BarPosition(bar)
    trainer = Trainer(
        strategy=strategy,
        max_steps=steps,
        callbacks=[checkpoints, bar, recorder, seen],
        logger=TensorBoardLogger(str(tmp_path), name="run"),
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=1,
    )
    data = PromptDataModule(train="digit_successor", batch_size=4, num_train_prompts=64, num_val_prompts=8)
    trainer.fit(module, datamodule=data)
    rl_steps = strategy.rl_steps
    strategy.shutdown()
    # the progress bar: RL step k/4
    assert seen.positions == [(1, steps), (2, steps), (3, steps), (4, steps)]
    # Lightning's counter: RL steps; the optimizer: 4 steps each
    assert trainer.global_step == steps and len(recorder.steps) == steps
    assert rl_steps == steps
    adam_steps = {int(s["step"]) for s in module.optimizers().optimizer.state.values()}
    assert adam_steps == {steps * per_step}
    # checkpoints every 2 RL steps
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt")) == [
        "epoch=0-step=2.ckpt",
        "epoch=0-step=4.ckpt",
    ]
    # the TensorBoard x-axis: one point per RL step, at its number (1 for the first)
    logged = read_scalars(trainer.log_dir)
    assert [s for s, _ in logged["rollout/reward_mean"]] == list(range(1, steps + 1))
    assert [s for s, _ in logged["train/lr"]] == list(range(1, steps + 1))
    # the schedule is stepped per optimizer step; its warmup and end are in RL steps
    expected = [
        lr * lr_factor(s * per_step, "linear", warmup * per_step, steps * per_step) for s in range(steps)
    ]
    assert all(
        math.isclose(v, e, rel_tol=1e-6, abs_tol=1e-12) for (_, v), e in zip(logged["train/lr"], expected)
    )
    assert expected[0] == 0.0 and expected[warmup] == lr
    assert module.optimizers().param_groups[0]["lr"] == 0.0  # decayed to 0 at max_steps RL steps
