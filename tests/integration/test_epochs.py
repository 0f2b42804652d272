"""Lightning's clocks mean what they mean: an epoch is one pass over the training prompts (the
datamodule's batches per pass), so ``max_epochs`` ends a run, ``on_train_epoch_end`` fires once a pass,
and monitors Lightning checks at epoch ends (``EarlyStopping``) stop it; ``max_steps`` still wins when
it comes first. The tiny recipe, 64 training prompts in batches of 16: 4 RL steps an epoch."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback, EarlyStopping

from unirl_lightning.cli.app import run_cli

pytestmark = pytest.mark.usefixtures("ray_local")

RECIPE = str(Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny.yaml")


class EpochCounter(Callback):
    def __init__(self) -> None:
        self.ends: list[tuple[int, int]] = []  # (epoch, RL steps so far) at each epoch end

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.ends.append((trainer.current_epoch, trainer.strategy.rl_steps))


def fit(tmp_path: Path, *args: str, callbacks: list) -> object:
    base = ["fit", "--config", RECIPE, "--data.num_train_prompts=64", "--trainer.enable_progress_bar=false"]
    base += [f"--trainer.logger.init_args.save_dir={tmp_path}", f"--trainer.default_root_dir={tmp_path}"]
    return run_cli([*base, *args], trainer_defaults={"callbacks": callbacks})


def test_max_epochs_ends_the_run_after_that_many_passes(tmp_path):
    counter = EpochCounter()
    cli = fit(tmp_path, "--trainer.max_steps=-1", "--trainer.max_epochs=2", callbacks=[counter])
    assert counter.ends == [(0, 4), (1, 8)]
    assert cli.trainer.strategy.rl_steps == 8 and cli.trainer.current_epoch == 2


def test_max_steps_still_ends_a_run_inside_an_epoch(tmp_path):
    counter = EpochCounter()
    cli = fit(tmp_path, "--trainer.max_steps=6", "--trainer.max_epochs=3", callbacks=[counter])
    assert cli.trainer.strategy.rl_steps == 6
    assert counter.ends[0] == (0, 4)


def test_early_stopping_on_the_reward_stops_at_the_first_epoch_end_past_its_threshold(tmp_path):
    stop = EarlyStopping(monitor="rollout/reward_mean", mode="max", stopping_threshold=0.01, patience=1000)
    counter = EpochCounter()
    cli = fit(tmp_path, "--trainer.max_steps=200", callbacks=[stop, counter])
    assert cli.trainer.callback_metrics["rollout/reward_mean"] >= 0.01
    assert cli.trainer.strategy.rl_steps == 4, counter.ends  # the first epoch end: 4 steps, not 200
    assert cli.trainer.should_stop and stop.stopped_epoch == 0
