"""Learning-rate schedules: the factor at step 0, at the end of warmup and at the end; a whole run
with warmup and cosine decay whose logged ``train/lr`` follows the schedule, with the step's own
learning rate; Lightning's ``--lr_scheduler`` refused naming the module's keys."""

from __future__ import annotations

import math

import pytest

from tests.builders import tiny_module
from unirl_lightning.modules.schedule import lr_factor


def test_the_factor_at_step_zero_warmup_and_end():
    for schedule in ("constant", "linear", "cosine"):
        assert lr_factor(0, schedule, 4, 20) == 0.0  # warmup starts at 0 (Hugging Face's convention)
        assert lr_factor(2, schedule, 4, 20) == 0.5
        assert lr_factor(4, schedule, 4, 20) == 1.0  # warmup done: the full rate
    assert lr_factor(20, "linear", 4, 20) == 0.0 and lr_factor(20, "cosine", 4, 20) == 0.0
    assert lr_factor(12, "linear", 4, 20) == 0.5
    assert math.isclose(lr_factor(12, "cosine", 4, 20), 0.5)
    assert lr_factor(19, "constant", 0, None) == 1.0


def test_bad_schedule_settings_name_the_key():
    with pytest.raises(
        ValueError, match=r"lr_schedule must be one of \('constant', 'linear', 'cosine'\), got 'cos'"
    ):
        tiny_module(lr_schedule="cos")
    with pytest.raises(ValueError, match=r"warmup_steps must be >= 0, got -1"):
        tiny_module(warmup_steps=-1)


def test_a_decaying_schedule_needs_max_steps():
    from lightning.pytorch import Trainer

    module = tiny_module(lr_schedule="cosine")
    module.trainer = Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"lr_schedule='cosine' decays to 0 at trainer.max_steps"):
        module.configure_optimizers()


def test_a_run_with_warmup_and_cosine_logs_the_scheduled_lr(tmp_path):
    from tests.builders import fit_tiny
    from unirl_lightning.cli.curves import read_scalars
    from unirl_lightning.strategy import AsyncRolloutStrategy

    steps, warmup, lr = 6, 2, 1e-3
    module = tiny_module(lr=lr, lr_schedule="cosine", warmup_steps=warmup)
    strategy = AsyncRolloutStrategy(max_staleness=1, max_inflight=2, max_worker_restarts=0)
    trainer, module, _ = fit_tiny(tmp_path, max_steps=steps, strategy=strategy, module=module)
    logged = read_scalars(trainer.log_dir)["train/lr"]
    expected = [lr * lr_factor(s, "cosine", warmup, steps) for s in range(steps)]
    assert len(logged) == steps  # TensorBoard keeps float32
    assert all(math.isclose(v, e, rel_tol=1e-6, abs_tol=1e-12) for (_, v), e in zip(logged, expected)), logged
    assert expected[0] == 0.0 and expected[warmup] == lr
    assert module.optimizers().param_groups[0]["lr"] == 0.0  # decayed to 0 at max_steps


def test_the_cli_refuses_lightnings_lr_scheduler_naming_the_module_keys(capsys):
    from unirl_lightning.cli.app import run_cli

    with pytest.raises(SystemExit) as exit_info:
        run_cli(
            [
                "fit",
                "--config",
                "examples/grpo_tiny.yaml",
                "--lr_scheduler",
                "torch.optim.lr_scheduler.StepLR",
                "--lr_scheduler.step_size",
                "5",
            ]
        )
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "model.init_args.lr_schedule" in last and "model.init_args.warmup_steps" in last
