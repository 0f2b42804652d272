"""The package works when installed from its wheel, outside the repository: the recipes and model
shapes ship as package data and are reachable by name, the demo runs, ``plan`` reads a packaged GPU
recipe's model shape, and every verb's help answers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh venv outside the repo with the wheel installed (no deps: the test's own environment's
    packages are visible through a path file, but not its editable install of this package)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # a copy: the build leaves its build/ folder there, not in the checkout
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("unirl_lightning", "examples"):
        shutil.copytree(REPO / name, source / name, ignore=skip)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(root / "dist"),
        ],
        check=True,
        cwd=root,
        timeout=600,
    )
    wheel = next((root / "dist").glob("unirl_lightning-*.whl"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        timeout=600,
    )
    work = root / "elsewhere"
    work.mkdir()
    return venv, work


def run(installed, *args, timeout=300):
    venv, work = installed
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(venv / "bin" / "unirl-lightning"), *args],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_installed_package_is_the_wheels_not_the_checkout(installed):
    venv, work = installed
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import unirl_lightning; print(unirl_lightning.__file__)"],
        cwd=work,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip().startswith(str(venv)), out.stdout


def test_recipes_are_listed_and_a_gpu_recipe_plans_by_name_with_its_model_shape(installed):
    listing = run(installed, "recipes")
    assert listing.returncode == 0, listing.stderr[-2000:]
    assert "grpo_tiny " in listing.stdout and "grpo_qwen2.5_7b_fsdp_vllm" in listing.stdout
    assert str(REPO) not in listing.stdout  # the packaged copy, not the checkout's examples/
    plan = run(installed, "plan", "--config", "grpo_qwen2.5_7b_fsdp_vllm", "--output", "plan.json")
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr[-2000:]
    result = json.loads((installed[1] / "plan.json").read_text())
    assert result["ok"] and "training_gpu" in result["figures"]  # the memory was estimated
    assert result["model_config"].endswith("recipes/model_configs/Qwen2.5-7B-Instruct")


@pytest.mark.parametrize("verb", ["fit", "export", "validate", "plan"])
def test_every_verbs_help_answers(installed, verb):
    out = run(installed, verb, "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout


def test_the_demo_runs_from_the_installed_package(installed):
    out = run(
        installed, "demo", "--trainer.max_steps", "4", "--trainer.enable_progress_bar", "false", timeout=600
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 4
    work = installed[1]
    assert (work / summary["reward_curve"]).is_file() and (
        work / summary["log_dir"] / "timeline.json"
    ).is_file()
