"""``unirl-lightning validate`` as a user runs it: a 2-step ``fit`` of the tiny recipe, then ``validate``
of the initial model and of ``--ckpt_path last``: one JSON line of figures each, evaluated on workers
that hold the checkpoint's weights (recorded by a callback at the evaluation and compared with the
checkpoint's), and the mistakes exit 2 naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from tests.integration.test_export import tiny_recipe, unirl

EVAL = {
    "class_path": "unirl_lightning.callbacks.RolloutEvalCallback",
    "init_args": {
        "every_n_steps": 100,
        "num_prompts": 8,
        "num_generations": 4,
        "temperature": 1.0,
        "pass_k": [2],
        "eval_on_start": False,
        "eval_on_end": False,
    },
}


class RecordWorkerWeights(Callback):
    """Save the weights the first rollout worker generates with, at fit start (after the push)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.strategy.runtime is not None and trainer.is_global_zero:
            torch.save(trainer.strategy.runtime.workers.call("state_dict")[0], self.path)


def record(tmp_path: Path, name: str) -> dict:
    return {
        "class_path": "tests.integration.test_validate.RecordWorkerWeights",
        "init_args": {"path": str(tmp_path / name)},
    }


def figures(run) -> dict[str, float]:
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, run.stdout[-2000:]
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("run")
    recipe = tiny_recipe(tmp_path, EVAL)
    unirl(tmp_path, "fit", "--config", str(recipe))
    return tmp_path, recipe


def expected_keys() -> set[str]:
    return {
        "eval/reward_mean",
        "eval/accuracy",
        "eval/weight_version",
        "eval/pass@1",
        "eval/pass@2",
        "eval/pass@4",
        "eval/mean@4",
        "eval/maj@4",
    }


def test_validate_a_checkpoint_prints_the_figures_from_its_weights(trained):
    tmp_path, recipe = trained
    [ckpt] = (tmp_path / "runs").glob("grpo_tiny/*/checkpoints/last.ckpt")
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
    trained_weights = {
        k.removeprefix("policy."): v for k, v in checkpoint["state_dict"].items() if k.startswith("policy.")
    }

    initial = figures(
        unirl(
            tmp_path,
            "validate",
            "--config",
            str(recipe),
            "--trainer.callbacks+",
            json.dumps(record(tmp_path, "w0.pt")),
        )
    )
    restored = figures(
        unirl(
            tmp_path,
            "validate",
            "--config",
            str(recipe),
            "--ckpt_path",
            "last",
            "--trainer.callbacks+",
            json.dumps(record(tmp_path, "w1.pt")),
        )
    )
    for metrics in (initial, restored):
        assert expected_keys() <= set(metrics), metrics
        assert 0 <= metrics["eval/pass@1"] <= metrics["eval/pass@2"] <= metrics["eval/pass@4"] <= 1
        assert metrics["eval/mean@4"] == pytest.approx(metrics["eval/accuracy"])
        assert metrics["eval/weight_version"] == 0.0
    served = torch.load(tmp_path / "w1.pt")
    assert served.keys() == trained_weights.keys()
    for name, tensor in trained_weights.items():
        torch.testing.assert_close(served[name], tensor.float(), rtol=0, atol=0)

    # a checkpoint whose weights surely differ from the initial model's (2 tiny steps may not move them)
    for name, tensor in checkpoint["state_dict"].items():
        if name.startswith("policy.") and tensor.is_floating_point():
            tensor.add_(0.01)
    torch.save(checkpoint, tmp_path / "moved.ckpt")
    moved = figures(
        unirl(
            tmp_path,
            "validate",
            "--config",
            str(recipe),
            "--ckpt_path",
            str(tmp_path / "moved.ckpt"),
            "--trainer.callbacks+",
            json.dumps(record(tmp_path, "w2.pt")),
        )
    )
    assert expected_keys() <= set(moved)
    served_initial, served_moved = torch.load(tmp_path / "w0.pt"), torch.load(tmp_path / "w2.pt")
    for name, tensor in checkpoint["state_dict"].items():
        if name.startswith("policy."):
            key = name.removeprefix("policy.")
            torch.testing.assert_close(served_moved[key], tensor.float(), rtol=0, atol=0)
            assert not torch.equal(served_initial[key], served_moved[key]) or not tensor.is_floating_point()


def test_validate_with_a_missing_checkpoint_exits_2_naming_it(tmp_path):
    import subprocess
    import sys

    from tests.integration.test_export import ROOT

    recipe = tiny_recipe(tmp_path, EVAL)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "unirl_lightning.cli",
            "validate",
            "--config",
            str(recipe),
            "--ckpt_path",
            "nope.ckpt",
        ],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), **__import__("os").environ},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "nope.ckpt" in run.stderr


def test_max_new_tokens_beyond_the_positions_fails_with_both_numbers(tmp_path):
    import subprocess
    import sys

    import yaml

    from tests.integration.test_export import ROOT

    recipe = tiny_recipe(tmp_path, EVAL)
    config = yaml.safe_load(recipe.read_text())
    config["model"]["init_args"]["max_new_tokens"] = 200
    recipe.write_text(yaml.safe_dump(config))
    run = subprocess.run(
        [sys.executable, "-m", "unirl_lightning.cli", "fit", "--config", str(recipe)],
        cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert "max_new_tokens=200" in run.stderr and "max_position_embeddings=64" in run.stderr, run.stderr[
        -2000:
    ]


@pytest.mark.slow
@pytest.mark.multirank
def test_validate_under_fsdp_two_ranks_serves_the_checkpoints_weights(tmp_path):
    """2 FSDP ranks (CPU, gloo): fit 2 steps, then ``validate --ckpt_path last``: one JSON line (rank 0),
    and rank 0's worker holds the checkpoint's (gathered) policy weights."""
    import yaml

    from tests.integration.test_export import ROOT
    from unirl_lightning.models.causal_lm import TinyCausalLM
    from unirl_lightning.models.export import load_policy_checkpoint
    from unirl_lightning.modules import GRPOModule

    config = yaml.safe_load((ROOT / "examples" / "grpo_tiny_fsdp.yaml").read_text())
    config["trainer"].update(max_steps=2, enable_progress_bar=False)
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "runs")
    config["trainer"]["callbacks"] = [
        EVAL,
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"every_n_train_steps": 1, "save_last": True},
        },
    ]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(config))
    unirl(tmp_path, "fit", "--config", str(recipe), timeout=500)
    run = unirl(
        tmp_path,
        "validate",
        "--config",
        str(recipe),
        "--ckpt_path",
        "last",
        "--trainer.callbacks+",
        json.dumps(record(tmp_path, "served.pt")),
        timeout=400,
    )
    assert expected_keys() <= set(figures(run))
    [ckpt] = (tmp_path / "runs").glob("grpo_tiny_fsdp/*/checkpoints/last.ckpt")
    module = GRPOModule(
        policy=TinyCausalLM(**config["model"]["init_args"]["policy"]["init_args"]), num_generations=2
    )
    load_policy_checkpoint(module, ckpt)
    served = torch.load(tmp_path / "served.pt")
    for name, tensor in module.policy.state_dict().items():
        torch.testing.assert_close(served[name], tensor.float(), rtol=0, atol=0)
