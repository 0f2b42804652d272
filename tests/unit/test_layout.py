"""The layer folders keep every former module path working: a recipe's ``class_path``, a user's import
and a pickled checkpoint naming a module where it used to live all reach the module where it lives now."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import unirl_lightning
from unirl_lightning import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_former_module_path_imports_the_module_where_it_moved(old):
    moved = importlib.import_module(f"unirl_lightning.{old}")
    assert moved is importlib.import_module(f"unirl_lightning.{MOVED[old]}")
    assert moved.__name__ == f"unirl_lightning.{MOVED[old]}"


def test_no_former_module_is_left_at_its_old_place():
    root = unirl_lightning.__path__[0]
    from pathlib import Path

    left = [old for old in MOVED if (Path(root) / (old.replace(".", "/") + ".py")).exists()]
    assert left == []


def test_the_names_recipes_and_users_typed_still_resolve():
    from unirl_lightning.models_diffusion import TinyFlowModel
    from unirl_lightning.rollout.agentic_loop import AgenticSpec

    from unirl_lightning.models import PretrainedCausalLM, TinyCausalLM
    from unirl_lightning.models.causal_lm import TinyCausalLM as moved

    assert TinyCausalLM is moved and PretrainedCausalLM.__module__ == "unirl_lightning.models.causal_lm"
    assert TinyFlowModel.__module__ == "unirl_lightning.models.diffusion"
    assert AgenticSpec.__module__ == "unirl_lightning.agentic.loop"
    with pytest.raises(AttributeError, match="no attribute 'NoSuchSpec'"):
        unirl_lightning.models.NoSuchSpec  # noqa: B018


def test_the_command_runs_as_a_module_and_lists_the_demo_verb():
    out = subprocess.run(
        [sys.executable, "-m", "unirl_lightning.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "demo" in out and "plan" in out
    bad = subprocess.run(
        [sys.executable, "-m", "unirl_lightning.cli", "dmeo"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "did you mean 'demo'" in bad.stderr


def test_a_config_names_a_bundled_recipe_by_name_and_a_path_stays_a_path(tmp_path):
    from unirl_lightning.cli.recipes import recipe_names, recipes_dir, resolve_config_names

    assert {"grpo_tiny", "grpo_qwen2.5_7b_fsdp_vllm"} <= set(recipe_names())
    tiny = str(recipes_dir() / "grpo_tiny.yaml")
    assert resolve_config_names(["fit", "--config", "grpo_tiny"]) == ["fit", "--config", tiny]
    assert resolve_config_names(["plan", "--config=grpo_tiny.yaml"]) == ["plan", f"--config={tiny}"]
    own = tmp_path / "grpo_tiny.yaml"  # a user's file of the same name wins only by its path
    assert resolve_config_names(["fit", "--config", str(own)]) == ["fit", "--config", str(own)]
    assert resolve_config_names(["fit", "--config", "no_such_recipe"]) == [
        "fit",
        "--config",
        "no_such_recipe",
    ]
