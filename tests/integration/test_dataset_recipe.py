"""examples/grpo_tiny_dataset.yaml: a recipe trained from a save_to_disk folder with TRL-style reward
functions parses, builds its data and reward, and trains logging each reward on its own; a file given
to grpo_tiny.yaml on the command line keeps the recipe's task arguments as a warning, not an error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.parse_only import ParseOnlyCLI
from unirl_lightning.cli.app import run_cli

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "grpo_tiny_dataset.yaml"


@pytest.fixture
def in_repo_root(monkeypatch, tmp_path):
    pytest.importorskip("datasets")
    monkeypatch.chdir(ROOT)  # the recipe's data and reward paths are relative to the repository root
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def test_the_dataset_recipe_parses_naming_its_folder_splits_columns_and_reward_functions(in_repo_root):
    config = ParseOnlyCLI(args=["--config", str(RECIPE)], run=False).config
    data = config.data.init_args
    assert data.train == "examples/data/digit_successor" and (data.split, data.val_split) == ("train", "test")
    assert (data.prompt_key, data.answer_key) == ("question", "solution")
    reward = config.model.init_args.reward.init_args
    assert reward.rewards == [
        "examples/rewards_trl.py:digit_reward",
        "examples/rewards_trl.py:answers_a_digit",
    ]


def test_the_dataset_recipe_builds_its_data_and_scores_with_its_reward(in_repo_root, tmp_path):
    from unirl_lightning.rewards import score_parts

    cli = run_cli(
        [
            "--config",
            str(RECIPE),
            f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
        ],
        run=False,
    )
    data = cli.datamodule
    train, held_out = data.train_records(), data.val_records()
    assert (len(train), len(held_out)) == (320, 64)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}  # disjoint, as written
    batch = next(iter(data.train_dataloader()))
    assert len(batch) == 16 and set(batch[0]) >= {"question", "solution", "prompt", "answer"}
    completions = [r["solution"] for r in batch[:2]] + ["x", ""]
    totals, parts = score_parts(cli.model.reward, completions, batch[:4])
    assert totals == pytest.approx([1.1, 1.1, 0.0, 0.0])
    assert parts == {"digit_reward": [1.0, 1.0, 0.0, 0.0], "answers_a_digit": [1.0, 1.0, 0.0, None]}


def test_a_file_given_to_the_task_recipe_ignores_its_task_kwargs_with_one_warning(tmp_path, caplog):
    pytest.importorskip("datasets")
    train = tmp_path / "my.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{i}=", "answer": str(i)}) + "\n" for i in range(20)))
    args = ["--config", str(ROOT / "examples" / "grpo_tiny.yaml"), f"--trainer.default_root_dir={tmp_path}"]
    args.append(f"--trainer.logger.init_args.save_dir={tmp_path}")
    with caplog.at_level("WARNING", logger="unirl_lightning.data.datamodule"):
        cli = run_cli([*args, "--data.init_args.train", str(train)], run=False)
    assert len(cli.datamodule.train_records()) == 20
    assert [r.getMessage() for r in caplog.records if "task_kwargs" in r.getMessage()] == [
        f"PromptDataModule: task_kwargs ['prefix_len'] are ignored: they only apply to built-in tasks, and "
        f"train={str(train)!r} and val=None are datasets."
    ]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_dataset_recipe_trains_and_logs_each_reward(tmp_path):
    pytest.importorskip("datasets")
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf_cache")}
    command = [
        sys.executable, "-m", "unirl_lightning.cli", "fit", "--config", str(RECIPE), "--trainer.max_steps", "4",
        "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stderr[-3000:]
    from unirl_lightning.cli.curves import read_scalars

    (run,) = (tmp_path / "runs" / "grpo_tiny_dataset").glob("version_*")
    scalars = read_scalars(run)
    for key in (
        "rollout/reward_mean",
        "rollout/reward/digit_reward_mean",
        "rollout/reward/answers_a_digit_mean",
    ):
        assert len(scalars[key]) == 4, key
    assert {"eval/reward/digit_reward_mean", "eval/reward/answers_a_digit_mean"} <= set(scalars)
