"""Two training ranks, DDP and FSDP2 (CPU, gloo, real Ray, tiny real model), each driving its own
rollout worker: the on-policy pin on every rank, identical parameters (FSDP: each rank holds half of
them and the gathered weights agree), workers bit-identical to the trainer, disjoint prompts, the
staleness bound across ranks, and kill-and-resume with 2 ranks. Each run is
tests/distributed/ddp_run.py in a subprocess (Lightning's launcher starts rank 1 from the script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multirank]  # make test-multirank

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS")


def run_two_ranks(
    out: Path, mode: str, max_steps: int, ckpt: Path | None = None, parallel: str = "ddp", *extra: str
) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["RAY_AUTH_MODE"] = "token"
    command = [sys.executable, str(ROOT / "tests" / "distributed" / "ddp_run.py"), "--out", str(out)]
    command += ["--mode", mode, "--max-steps", str(max_steps), "--parallel", parallel]
    command += (["--ckpt", str(ckpt)] if ckpt else []) + list(extra)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in (0, 1):
        (out / f"rank{r}.json").unlink()
    return ranks


def prompts(ranks: list[dict]) -> list[str]:
    return [p for rank in ranks for step in rank["steps"] for p in step["prompts"]]


def check_sharding(ranks: list[dict], parallel: str) -> None:
    held = [rank["held_fraction"] for rank in ranks]
    if parallel == "fsdp":  # every rank holds its shard only, and the shards add up to the model
        assert max(held) < 0.6 and abs(sum(held) - 1.0) < 1e-6, held
    else:
        assert held == [1.0, 1.0]


@pytest.mark.parametrize(
    "parallel, weight_sync",
    # FSDP with the collective backend: the sharded weights are gathered bucket by bucket as they are sent
    [("ddp", "object_store"), ("fsdp", "collective")],
)
def test_two_synchronous_ranks_stay_on_policy_identical_and_disjoint(tmp_path, parallel, weight_sync):
    ranks = run_two_ranks(tmp_path, "sync", 4, None, parallel, "--weight-sync", weight_sync)
    check_sharding(ranks, parallel)
    for rank in ranks:
        assert len(rank["steps"]) == 4
        for step in rank["steps"]:
            assert set(step["row_versions"]) == {step["version"]}
            assert abs(step["ratio_mean"] - 1.0) < 1e-3 and step["logp_diff_abs"] < 1e-4
        assert rank["workers_equal"], "a rank's workers differ from its trainer after the last push"
    assert ranks[0]["checksum"] == ranks[1]["checksum"], "DDP ranks diverged"
    trained = prompts(ranks)
    assert len(trained) == len(set(trained)) == 2 * 4 * 4, "a prompt was trained by two ranks"


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_async_ranks_keep_the_bound_and_resume_losing_and_repeating_no_prompt(tmp_path, parallel):
    # FSDP writes sharded checkpoints here (a folder per checkpoint, last.ckpt replaced every step)
    extra = ["--sharded-checkpoint"] if parallel == "fsdp" else []
    first = run_two_ranks(tmp_path, "async", 4, None, parallel, *extra)
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    assert ckpt.is_dir() == (parallel == "fsdp")
    second = run_two_ranks(tmp_path, "async", 8, ckpt, parallel, *extra)
    for before, after in zip(first, second):
        staleness = [s["version"] - v for s in before["steps"] + after["steps"] for v in s["row_versions"]]
        assert max(staleness) == 1 and min(staleness) >= 0, "async: bounded, and staleness 1 occurs"
        # per rank: every gen_id trained once; launched = trained + evicted + still pending
        trained = [g for s in before["steps"] for g in s["gen_ids"]]
        assert len(trained) == len(set(trained))
        assert set(range(before["next_gen_id"])) == set(trained) | set(before["evicted"]) | set(
            before["untrained"]
        )
        # the resumed rank relaunches its own untrained prompts first
        assert set(before["untrained_prompts"]) == set(after["steps"][0]["prompts"])
        assert after["steps"][0]["version"] == before["steps"][-1]["version"] + 2  # last sync + re-push
        # the workers start the resumed run with the restored weights (FSDP restores them after the
        # workers started: WeightSyncCallback's re-push at train start must come after the restore)
        assert after["workers_equal_at_start"] and after["workers_equal"]
    trained = prompts(first) + prompts(second)
    assert len(trained) == len(set(trained)), "a prompt was trained twice across ranks or across the resume"
    assert first[0]["checksum"] == first[1]["checksum"] and second[0]["checksum"] == second[1]["checksum"]
