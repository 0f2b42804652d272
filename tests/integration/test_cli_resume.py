"""Resume as a user does it: ``unirl-lightning fit`` in a subprocess, SIGKILL after a checkpoint, then
``--ckpt_path last``. Nothing of the killed run outlives it; the resumed run continues from the
checkpoint's step and version, in the same run folder, async from its first step, and no prompt is
lost or trained twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def cli(tmp_path: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "unirl_lightning.cli",
        "fit",
        "--config",
        str(ROOT / "examples" / "grpo_tiny.yaml"),
        f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
        "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps=5",
        "--trainer.callbacks.save_last=true",
        "--trainer.callbacks+=tests.run_recorder.JsonStepRecorder",
        f"--trainer.callbacks.path={tmp_path / 'steps.jsonl'}",
        "--model.init_args.policy.init_args.hidden_size=32",
        "--model.init_args.policy.init_args.num_layers=1",
        "--model.init_args.num_generations=4",
        "--data.init_args.batch_size=4",
        "--data.init_args.num_train_prompts=400",
        "--data.init_args.task_kwargs={prefix_len: 6}",
        "--data.init_args.shuffle=false",
        *extra,
    ]


def steps(tmp_path: Path) -> list[dict]:
    path = tmp_path / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_sigkill_then_resume_with_ckpt_path_last_continues_async_and_loses_no_prompt(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ckpt = tmp_path / "runs" / "grpo_tiny" / "version_0" / "checkpoints" / "last.ckpt"
    first = subprocess.Popen(
        cli(tmp_path, "--trainer.max_steps=200"),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 240
    while time.time() < deadline and not (len(steps(tmp_path)) >= 13 and ckpt.exists()):
        assert first.poll() is None, first.stderr.read().decode()[-3000:]
        time.sleep(0.2)
    descendants = psutil.Process(first.pid).children(recursive=True)
    assert descendants, "the run should have Ray processes"
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    # read after the kill: the run may write a newer last.ckpt until it dies (the resume uses that one)
    checkpoint = torch.load(ckpt, weights_only=True)  # plain Python types only
    gone_by = time.time() + 10
    while time.time() < gone_by and [p for p in descendants if p.is_running() and p.status() != "zombie"]:
        time.sleep(0.2)
    alive = [p for p in descendants if p.is_running() and p.status() != "zombie"]
    assert not alive, f"processes outlived the killed driver by 10 s: {alive}"

    killed = steps(tmp_path)
    (tmp_path / "steps.jsonl").unlink()
    resumed_steps = 6
    total = checkpoint["global_step"] + resumed_steps
    second = subprocess.run(
        cli(tmp_path, f"--trainer.max_steps={total}", "--ckpt_path=last"),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = steps(tmp_path)
    assert len(resumed) == resumed_steps
    assert not (tmp_path / "runs" / "grpo_tiny" / "version_1").exists(), (
        "the resumed run must log into its folder"
    )
    saved_steps = checkpoint["global_step"]
    assert resumed[0]["global_step"] == saved_steps
    assert (
        resumed[0]["version"] == checkpoint["unirl_rollout"]["ranks"][0]["weight_version"] + 1
    )  # re-pushed once at start
    # async again from the first resumed step: a request in flight while it trains, staleness 1 occurs
    assert resumed[0]["inflight"] >= 1
    staleness = [s["version"] - v for s in resumed for v in s["row_versions"]]
    assert max(staleness) == 1 and min(staleness) >= 0
    # prompts: what the checkpoint had trained, then the resumed run; none twice, none lost
    before = [p for s in killed[:saved_steps] for p in s["prompts"]]
    after = [p for s in resumed for p in s["prompts"]]
    assert len(before + after) == len(set(before + after)), "a prompt was trained twice across the resume"
    pending = {
        r["prompt"] for records in checkpoint["unirl_rollout"]["ranks"][0]["untrained"] for r in records
    }
    assert pending <= set(after), "launched-but-untrained prompts at the checkpoint must be trained first"
