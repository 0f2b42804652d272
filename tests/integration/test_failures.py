"""Failures stop the run with a clear error and leave no Ray process behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil

SCRIPT = textwrap.dedent(
    """
    import torch
    from lightning.pytorch import Trainer
    from unirl_lightning import AsyncRolloutStrategy, GRPOModule, PromptDataModule, TinyCausalLM

    def broken_reward(completion, record):
        raise ZeroDivisionError("boom")

    if __name__ == "__main__":
        torch.set_num_threads(1)
        module = GRPOModule(policy=TinyCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
                            reward="__main__:broken_reward", num_generations=2, max_new_tokens=2)
        trainer = Trainer(strategy=AsyncRolloutStrategy(), max_steps=2, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, limit_val_batches=0)
        trainer.fit(module, datamodule=PromptDataModule(train="digit_successor", batch_size=2,
                                                        num_train_prompts=8))
    """
)


def ray_pids() -> set[int]:
    pids = set()
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "ray::" in cmd or "raylet" in cmd or "gcs_server" in cmd or "ray/_private" in cmd:
            pids.add(proc.info["pid"])
    return pids


def test_reward_error_names_reward_and_prompt_and_leaves_no_ray_process(tmp_path):
    before = ray_pids()
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert out.returncode != 0
    assert "RewardError" in out.stderr
    assert "broken_reward" in out.stderr
    assert "prompt" in out.stderr and "=" in out.stderr
    deadline = time.time() + 30
    while time.time() < deadline and ray_pids() - before:
        time.sleep(0.5)
    assert not (ray_pids() - before), f"Ray processes outlived the run: {ray_pids() - before}"
