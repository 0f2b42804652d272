"""``unirl-lightning export`` as a user runs it: a short ``fit`` of the tiny recipe in a subprocess, then
``export`` of its checkpoint (with the config the run saved, and with ``--ckpt_path last``), loaded back
with transformers; the callback exports at the end of a fit; and the mistakes exit 2 naming what is wrong."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from unirl_lightning.cli.verbs import main

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "grpo_tiny.yaml"
PROMPTS = ["1+2=", "3*4=", "7=", "12-5="]


def tiny_recipe(tmp_path: Path, *callbacks: dict) -> Path:
    """The tiny recipe, smaller and quieter, logging under ``tmp_path/runs``, checkpointing every step."""
    config = yaml.safe_load(RECIPE.read_text())
    trainer = config["trainer"]
    trainer.update(max_steps=2, enable_progress_bar=False)
    trainer["logger"]["init_args"]["save_dir"] = str(tmp_path / "runs")
    trainer["callbacks"] = [
        c
        for c in trainer["callbacks"]
        if not c["class_path"].endswith(("RolloutEvalCallback", "ModelCheckpoint"))
    ]
    trainer["callbacks"] += [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"every_n_train_steps": 1, "save_last": True},
        },
        *callbacks,
    ]
    config["model"]["init_args"].update(num_generations=4)
    config["model"]["init_args"]["policy"]["init_args"].update(hidden_size=32, num_layers=1, num_heads=1)
    config["data"]["init_args"].update(batch_size=4, num_train_prompts=32, num_val_prompts=8)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def unirl(tmp_path: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [sys.executable, "-m", "unirl_lightning.cli", *args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def greedy(model, tokenizer) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        tokens = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False
        )
        out.append(tokens[0, ids.shape[1] :].tolist())
    return out


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A 2-step fit of the tiny recipe (checkpoint every step; the callback exports at the end)."""
    tmp_path = tmp_path_factory.mktemp("run")
    recipe = tiny_recipe(
        tmp_path,
        {
            "class_path": "unirl_lightning.callbacks.ExportOnTrainEnd",
            "init_args": {"output": str(tmp_path / "cb")},
        },
    )
    unirl(tmp_path, "fit", "--config", str(recipe))
    version = tmp_path / "runs" / "grpo_tiny" / "version_0"
    return tmp_path, recipe, version


@pytest.mark.slow
def test_fit_then_export_loads_with_transformers_with_the_trained_weights(trained_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp_path, recipe, version = trained_run
    ckpt = version / "checkpoints" / "last.ckpt"
    out = unirl(tmp_path, "export", "--config", str(recipe), "--ckpt_path", str(ckpt), "--output", "hf")
    assert f"Exported to {Path('hf')}" in out.stdout
    # the run's own saved config exports too, and --ckpt_path last finds the run's newest checkpoint
    unirl(
        tmp_path, "export", "--config", str(version / "config.yaml"), "--ckpt_path", "last", "--output", "hf2"
    )

    checkpoint = torch.load(ckpt, weights_only=True)
    assert checkpoint["global_step"] == 2
    trained = {
        k.removeprefix("policy."): v for k, v in checkpoint["state_dict"].items() if k.startswith("policy.")
    }
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    outputs = []
    for folder in ("hf", "hf2", "cb"):  # the CLI twice, and the callback at the end of the fit
        model = AutoModelForCausalLM.from_pretrained(tmp_path / folder)
        state = model.state_dict()
        assert set(state) == set(trained)
        assert all(torch.equal(state[k], v) for k, v in trained.items()), folder
        outputs.append(greedy(model, tokenizer))
    assert outputs[0] == outputs[1] == outputs[2]


def export_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["export", *args])
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_export_without_a_checkpoint_file_names_it(tmp_path, capsys):
    err = export_error(
        capsys, "--config", str(RECIPE), "--ckpt_path", "nope/last.ckpt", "--output", str(tmp_path)
    )
    assert "ckpt_path 'nope/last.ckpt' does not exist" in err
    err = export_error(capsys, "--config", str(RECIPE), "--output", str(tmp_path / "hf"))
    assert "export needs --ckpt_path" in err


def test_export_refuses_a_non_empty_output_unless_overwrite(tmp_path, capsys):
    ckpt = tmp_path / "x.ckpt"
    ckpt.write_bytes(b"")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    err = export_error(
        capsys, "--config", str(RECIPE), "--ckpt_path", str(ckpt), "--output", str(tmp_path / "hf")
    )
    assert "exists and is not empty" in err and "--overwrite" in err
    assert (tmp_path / "hf" / "keep.txt").read_text() == "mine"


def test_export_merge_of_a_full_policy_says_it_is_already_full(tmp_path, capsys):
    ckpt = tmp_path / "x.ckpt"
    ckpt.write_bytes(b"")
    err = export_error(
        capsys, "--config", str(RECIPE), "--ckpt_path", str(ckpt), "--output", str(tmp_path / "hf"), "--merge"
    )
    assert "--merge: the policy has no LoRA adapters" in err and "already the full model" in err
