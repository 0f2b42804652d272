"""A checkpoint written before the house redesign (commit 49b2cdb, by ``tests/fixtures/make_checkpoint.py``
at that commit: the tiny module, 2 async steps) resumes after it: same state-dict keys, the rollout
state's version ledger and untrained groups restored, training continues."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.builders import tiny_module
from tests.integration.test_resume import fit_recording, unique_prompts
from unirl_lightning.strategy import AsyncRolloutStrategy

pytestmark = pytest.mark.usefixtures("ray_local")

LEGACY = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_49b2cdb.ckpt"


def test_a_checkpoint_from_before_the_redesign_resumes(tmp_path):
    ckpt = tmp_path / "legacy.ckpt"
    shutil.copy(LEGACY, ckpt)
    saved = torch.load(ckpt, weights_only=False)
    assert sorted(tiny_module().state_dict()) == sorted(saved["state_dict"])  # checkpoint keys unchanged
    strategy = AsyncRolloutStrategy(max_staleness=1, max_inflight=2)
    recorder, loop = fit_recording(tmp_path, strategy, unique_prompts(), max_steps=4, ckpt_path=str(ckpt))
    state = saved["unirl_rollout"]["ranks"][0]
    assert saved["global_step"] == 2 and len(recorder.steps) == 2
    # the ledger continued from the saved version (re-pushed once at start), within the bound
    assert recorder.steps[0]["version"] == state["weight_version"] + 1
    assert max(s["version"] - v for s in recorder.steps for v in s["row_versions"]) <= 1
    # the saved, launched-but-untrained prompts were relaunched first and trained
    pending = {record["prompt"] for records in state["untrained"] for record in records}
    assert len(pending) == 4 and pending <= recorder.steps[0]["prompts"]
    assert loop.evicted_groups == 0
