"""Lightning conformance: every Trainer flag, standard callback and logger a Lightning user reaches for
either works as Lightning documents it, checked by what it produces (a file, a stop, a figure), or is
refused at parse time with exit 2, naming the key and this library's equivalent. ``docs/lightning.md``
lists every row with the test that checks it. The hybrid recipe (no Ray) with 64 training prompts in
batches of 16: 4 RL steps an epoch."""

from __future__ import annotations

import csv
import datetime
import logging
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import (
    Callback,
    DeviceStatsMonitor,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    RichProgressBar,
    Timer,
    TQDMProgressBar,
)

from unirl_lightning.cli.app import run_cli
from unirl_lightning.cli.curves import read_scalars

RECIPE = str(Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny_hybrid.yaml")


RECIPE_CALLBACKS = [
    {"class_path": "unirl_lightning.callbacks.WeightSyncCallback"},
    {
        "class_path": "unirl_lightning.callbacks.RolloutEvalCallback",
        "init_args": {"every_n_steps": 2, "num_prompts": 16},
    },
]
BAR = {"class_path": "lightning.pytorch.callbacks.TQDMProgressBar", "init_args": {"refresh_rate": 2}}


class Probe(Callback):
    """What the trainer's flags switched on, seen from inside a training step's hooks."""

    def __init__(self) -> None:
        self.anomaly: list[bool] = []
        self.deterministic: list[bool] = []
        self.epoch_ends: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.anomaly.append(torch.is_anomaly_enabled())
        self.deterministic.append(torch.are_deterministic_algorithms_enabled())

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.epoch_ends.append(trainer.strategy.rl_steps)


@pytest.fixture
def run(tmp_path, monkeypatch):
    """``run(*flags, callbacks=[...], extra={...})``: fit the hybrid recipe in ``tmp_path`` with an
    evaluation every 2 steps on 16 held-out prompts (``extra`` is merged over the trainer's YAML)."""
    monkeypatch.chdir(tmp_path)
    previous = torch.are_deterministic_algorithms_enabled()

    def fit(*flags: str, callbacks: list | None = None, extra: dict | None = None, prompts: int = 64):
        trainer = {
            "callbacks": RECIPE_CALLBACKS,
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": "tb"},
            },
            **(extra or {}),
        }
        override = tmp_path / "override.yaml"
        override.write_text(yaml.safe_dump({"trainer": trainer}))
        args = ["fit", "--config", RECIPE, "--config", str(override), f"--data.num_train_prompts={prompts}"]
        return run_cli(
            [*args, "--trainer.max_steps=4", *flags], trainer_defaults={"callbacks": callbacks or []}
        )

    yield fit
    torch.use_deterministic_algorithms(previous)


def refused(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["fit", "--config", RECIPE, *args])
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("flag", "equivalent"),
    [
        ("--trainer.accumulate_grad_batches=4", "model.init_args.micro_batch_rows"),
        ("--trainer.gradient_clip_val=0.5", "model.init_args.max_grad_norm"),
        ("--trainer.gradient_clip_algorithm=value", "model.init_args.max_grad_norm"),
        ("--trainer.val_check_interval=2", "RolloutEvalCallback(every_n_steps=N)"),
        ("--trainer.check_val_every_n_epoch=2", "RolloutEvalCallback(every_n_steps=N)"),
        ("--trainer.num_sanity_val_steps=2", "RolloutEvalCallback(eval_on_start=True)"),
        ("--trainer.callbacks+=StochasticWeightAveraging", "automatic optimization"),
        ("--trainer.callbacks+=GradientAccumulationScheduler", "model.init_args.micro_batch_rows"),
    ],
)
def test_a_flag_the_rl_modules_cannot_honour_is_refused_naming_its_equivalent(
    flag, equivalent, capsys, tmp_path
):
    extra = []
    if "StochasticWeightAveraging" in flag:
        extra = ["--trainer.callbacks.swa_lrs=0.01"]
    if "GradientAccumulationScheduler" in flag:
        extra = ["--trainer.callbacks.scheduling={0: 2}"]
    last = refused([flag, *extra], capsys)
    key = flag.split("=")[0].removeprefix("--").replace("+", "")
    assert last.startswith(f"error: {key}") and equivalent in last, last


def test_the_standard_callbacks_loggers_and_flags_work_in_one_run(run, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    probe, timer, lr = Probe(), Timer(), LearningRateMonitor(logging_interval="step")
    best = ModelCheckpoint(
        dirpath=tmp_path / "best", monitor="eval/accuracy", mode="max", save_top_k=1, every_n_train_steps=2
    )
    timed = ModelCheckpoint(
        dirpath=tmp_path / "timed", save_last=True, train_time_interval=datetime.timedelta(milliseconds=1)
    )
    callbacks = [
        probe,
        timer,
        lr,
        best,
        timed,
        ModelSummary(max_depth=1),
        DeviceStatsMonitor(cpu_stats=True),
    ]
    loggers = [
        {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": "tb"}},
        {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "csv"}},
    ]
    profiler = {
        "class_path": "lightning.pytorch.profilers.SimpleProfiler",
        "init_args": {"filename": "simple"},
    }
    cli = run(
        "--trainer.deterministic=true",
        "--trainer.detect_anomaly=true",
        "--trainer.log_every_n_steps=1",
        "--trainer.precision=bf16-mixed",
        "--trainer.enable_progress_bar=true",
        f"--trainer.default_root_dir={tmp_path / 'root'}",
        callbacks=callbacks,
        extra={"logger": loggers, "profiler": profiler, "callbacks": [*RECIPE_CALLBACKS, BAR]},
    )
    trainer = cli.trainer
    assert trainer.strategy.rl_steps == 4
    assert probe.anomaly == [True] * 4 and probe.deterministic == [True] * 4  # detect_anomaly, deterministic
    assert type(trainer.progress_bar_callback) is TQDMProgressBar  # the user's bar replaces the RL bar
    assert "Total params" in caplog.text  # ModelSummary
    assert timer.time_elapsed("train") > 0
    with open(next((tmp_path / "csv").rglob("metrics.csv"))) as handle:
        rows = list(csv.DictReader(handle))
    columns = set(rows[0])
    assert {"rollout/reward_mean", "eval/accuracy", "lr-AdamW"} <= columns  # CSVLogger, LearningRateMonitor
    assert any("cpu_percent" in column for column in columns)  # DeviceStatsMonitor
    scalars = read_scalars(next((tmp_path / "tb").rglob("events.out.tfevents.*")).parent)
    assert len(scalars["rollout/reward_mean"]) == 4  # TensorBoard, log_every_n_steps=1
    accuracy = [float(r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") not in (None, "")]
    assert best.best_model_score is not None and float(best.best_model_score) == max(accuracy)
    assert Path(best.best_model_path).is_file()  # monitor + save_top_k + every_n_train_steps
    assert (tmp_path / "timed" / "last.ckpt").is_file()  # save_last + train_time_interval
    assert trainer.precision == "bf16-mixed"
    report = tmp_path / "root"
    assert trainer.default_root_dir == str(report)
    assert "training_step" in next(tmp_path.rglob("fit-simple.txt")).read_text()  # SimpleProfiler


def test_epochs_limits_and_time_stop_the_run_where_lightning_says(run):
    probe = Probe()
    cli = run(
        "--trainer.max_steps=-1",
        "--trainer.max_epochs=2",
        "--trainer.limit_train_batches=2",
        callbacks=[probe],
    )
    assert probe.epoch_ends == [2, 4] and cli.trainer.strategy.rl_steps == 4  # limit_train_batches per epoch
    stop = EarlyStopping(monitor="rollout/reward_mean", mode="max", stopping_threshold=-1.0)
    probe = Probe()
    cli = run("--trainer.max_steps=-1", "--trainer.min_epochs=2", callbacks=[stop, probe], prompts=32)
    assert probe.epoch_ends == [2, 4]  # EarlyStopping fires at the first epoch end, min_epochs holds it to 2
    cli = run("--trainer.max_steps=-1", "--trainer.max_time=00:00:00:03")
    assert 0 < cli.trainer.strategy.rl_steps and cli.trainer.current_epoch < 100  # ended by the clock


def test_fast_dev_run_takes_one_step_and_writes_nothing(run, tmp_path):
    rich = {"class_path": "lightning.pytorch.callbacks.RichProgressBar"}
    cli = run("--trainer.fast_dev_run=true", extra={"callbacks": [*RECIPE_CALLBACKS, rich]})
    assert cli.trainer.strategy.rl_steps == 1
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("events.out.tfevents.*"))
    assert isinstance(cli.trainer.progress_bar_callback, RichProgressBar)


def test_enable_checkpointing_false_leaves_the_recipes_checkpoint_out(run, tmp_path):
    extra = {"callbacks": [*RECIPE_CALLBACKS, {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint"}]}
    cli = run("--trainer.enable_checkpointing=false", "--trainer.max_steps=2", extra=extra)
    assert cli.trainer.checkpoint_callback is None and not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-true"])
def test_every_precision_trains(run, precision):
    cli = run(f"--trainer.precision={precision}", "--trainer.max_steps=2")
    assert cli.trainer.strategy.rl_steps == 2
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])


@pytest.mark.parametrize(
    ("profiler", "written"), [("advanced", "fit-advanced.txt"), ("pytorch", "fit-pytorch.txt")]
)
def test_the_profilers_write_their_reports(run, tmp_path, profiler, written):
    path = (
        f"lightning.pytorch.profilers.{profiler.capitalize() if profiler != 'pytorch' else 'PyTorch'}Profiler"
    )
    extra = {
        "profiler": {
            "class_path": path,
            "init_args": {"filename": profiler, "dirpath": str(tmp_path / "prof")},
        }
    }
    run("--trainer.max_steps=2", extra=extra)
    assert (tmp_path / "prof" / written).stat().st_size > 0


def test_wandb_offline_mlflow_file_store_and_two_loggers_at_once(run, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    loggers = [
        {
            "class_path": "lightning.pytorch.loggers.WandbLogger",
            "init_args": {"offline": True, "save_dir": "wb"},
        },
        {
            "class_path": "lightning.pytorch.loggers.MLFlowLogger",
            "init_args": {"tracking_uri": f"file:{tmp_path / 'mlruns'}"},
        },
    ]
    run("--trainer.max_steps=2", extra={"logger": loggers})
    assert list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    metric = list((tmp_path / "mlruns").rglob("metrics/rollout/reward_mean"))
    assert metric and len(metric[0].read_text().splitlines()) == 2
