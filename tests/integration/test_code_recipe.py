"""The code recipe (``examples/grpo_code_tiny.yaml``) from the CLI: the completions are run in the
rollout worker's sandbox, never in the trainer's process, and the reward is logged under its name
(``rollout/reward/code_execution_mean``, ``eval/reward/...``) and in the evaluation's completions table."""

from __future__ import annotations

from pathlib import Path

import pytest

from unirl_lightning.cli.app import run_cli
from unirl_lightning.cli.curves import read_scalars
from unirl_lightning.rewards.sandbox import Sandbox, SandboxUnavailableError

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "grpo_code_tiny.yaml"


def _sandbox_works() -> bool:
    try:
        return Sandbox().check() == "bwrap"
    except SandboxUnavailableError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not _sandbox_works(), reason="bubblewrap is not installed or cannot sandbox here")
def test_the_code_recipe_runs_its_sandbox_in_the_worker_and_logs_the_reward(tmp_path, monkeypatch, ray_local):
    def in_the_trainer(self, payload, slot=0):
        raise AssertionError("model-written code ran in the trainer's process")

    monkeypatch.setattr(Sandbox, "run", in_the_trainer)  # this process only: the Ray worker has its own
    run_cli(
        [
            "fit",
            "--config",
            str(RECIPE),
            "--trainer.max_steps=4",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
        ]
    )
    (run,) = (tmp_path / "runs" / "grpo_code_tiny").glob("version_*")
    scalars = read_scalars(run)
    assert len(scalars["rollout/reward/code_execution_mean"]) == 4
    assert all(0.0 <= value <= 1.0 for _, value in scalars["rollout/reward/code_execution_mean"])
    assert [step for step, _ in scalars["eval/reward/code_execution_mean"]] == [0, 4]  # before and after

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = run.glob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events), size_guidance={"tensors": 0})
    accumulator.Reload()
    table = accumulator.Tensors("eval/completions/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert table.splitlines()[0].endswith("| reward parts |") and "code_execution=" in table
    assert accumulator.Tensors("rollout/completions/text_summary")  # the training table: the total reward
