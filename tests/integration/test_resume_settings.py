"""Resume semantics: ``--ckpt_path last`` and the checkpoint file's own path resume alike. The
checkpoint's module settings win over the config's (Lightning's rule for a file, now also for
``last``), and each setting the config gives otherwise is named in a warning. ``export --ckpt_path
last`` without a checkpoint says what export needs."""

from __future__ import annotations

import shutil
import warnings

import pytest

from unirl_lightning.cli.app import ExportCLI, run_cli

TINY = [
    "--config",
    "examples/grpo_tiny.yaml",
    "--trainer.enable_progress_bar=false",
    "--model.init_args.policy.init_args.hidden_size=32",
    "--model.init_args.policy.init_args.num_layers=1",
    "--model.init_args.num_generations=4",
    "--data.init_args.batch_size=4",
    "--trainer.callbacks.every_n_train_steps=1",
]


def fit(save_dir, *extra: str):
    cli = run_cli(["fit", *TINY, f"--trainer.logger.init_args.save_dir={save_dir}", *extra])
    lrs = (cli.model.lr, cli.trainer.optimizers[0].param_groups[0]["lr"], cli.trainer.global_step)
    cli.trainer.strategy.shutdown()
    return lrs


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, ray_local):
    root = tmp_path_factory.mktemp("resume")
    assert fit(root / "runs", "--trainer.max_steps=2") == (0.00075, 0.00075, 2)
    return root / "runs"


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", ["last", "path"])
def test_last_and_the_path_resume_with_the_checkpoints_settings_naming_the_edited_one(
    saved_run, tmp_path, ckpt
):
    runs = tmp_path / "runs"
    shutil.copytree(saved_run, runs)
    path = runs / "grpo_tiny" / "version_0" / "checkpoints" / "last.ckpt"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = fit(
            runs,
            "--trainer.max_steps=3",
            "--model.init_args.lr=0.5",
            f"--ckpt_path={'last' if ckpt == 'last' else path}",
        )
    # the module's setting and the optimizer's (restored with its state) agree: the checkpoint's
    assert resumed == (0.00075, 0.00075, 3)
    named = [str(w.message) for w in caught if "model.init_args.lr" in str(w.message)]
    assert named == [
        "model.init_args.lr: the config says 0.5, the checkpoint 0.00075; resuming with the checkpoint's 0.00075 "
        "(a resume continues the saved run; start a new run to change it)"
    ]


def test_export_last_without_a_checkpoint_says_what_export_needs(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ExportCLI(
            args=[
                *TINY,
                f"--trainer.logger.init_args.save_dir={tmp_path}",
                "--ckpt_path=last",
                f"--output={tmp_path / 'out'}",
            ]
        )
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "there is no last*.ckpt" in last
    assert last.endswith("give the checkpoint's path (a .ckpt file or a sharded checkpoint folder)")
    assert "start a new run" not in last
