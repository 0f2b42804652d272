"""Two training ranks, DDP and FSDP2 (CPU, gloo, real Ray, tiny real model), each driving its own
rollout worker: the on-policy pin on every rank, identical parameters (FSDP: each rank holds half of
them and the gathered weights agree), workers bit-identical to the trainer, disjoint prompts, the
staleness bound across ranks, and kill-and-resume with 2 ranks. Failures: a worker of rank 1 killed
under FSDP is replaced from the kept push (no gather on one rank); an exception on rank 1 ends the
run on every rank within the process group's timeout, leaving no process behind. Each run is
tests/distributed/ddp_run.py in a subprocess (Lightning's launcher starts rank 1 from the script)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.multirank]  # make test-multirank

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS")


RUN_MARKER = "UNIRL_TEST_RUN"  # every process of a run inherits it (Ray's head and workers too)


def launch(
    out: Path, mode: str, max_steps: int, ckpt: Path | None, parallel: str, *extra: str, marker: str = ""
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["RAY_AUTH_MODE"] = "token"
    env[RUN_MARKER] = marker
    command = [sys.executable, str(ROOT / "tests" / "distributed" / "ddp_run.py"), "--out", str(out)]
    command += ["--mode", mode, "--max-steps", str(max_steps), "--parallel", parallel]
    command += (["--ckpt", str(ckpt)] if ckpt else []) + list(extra)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


def run_two_ranks(
    out: Path, mode: str, max_steps: int, ckpt: Path | None = None, parallel: str = "ddp", *extra: str
) -> list[dict]:
    done = launch(out, mode, max_steps, ckpt, parallel, *extra)
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


def test_two_hybrid_ranks_each_with_its_own_in_process_engine_stay_on_policy_and_serve_the_same_weights(
    tmp_path,
):
    """``placement="hybrid"`` on 2 DDP ranks (HF engine): each rank's engine lives in its own training
    process (no Ray imported), every step of both ranks is on-policy, and after the last sync the two
    engines serve the same weights, the trainers' own."""
    ranks = run_two_ranks(
        tmp_path, "sync", 4, None, "ddp", "--placement", "hybrid", "--weight-sync", "inprocess"
    )
    check_sharding(ranks, "ddp")
    for rank in ranks:
        assert rank["worker_pids"] == [rank["pid"]], "the engine is not in the rank's own process"
        assert not rank["ray_imported"]
        assert len(rank["steps"]) == 4
        for step in rank["steps"]:
            assert set(step["row_versions"]) == {step["version"]}
            assert abs(step["ratio_mean"] - 1.0) < 1e-3 and step["logp_diff_abs"] < 1e-4
        assert rank["workers_equal"] and rank["worker_checksums"] == [rank["checksum"]]
    assert ranks[0]["pid"] != ranks[1]["pid"]
    assert ranks[0]["worker_checksums"] == ranks[1]["worker_checksums"], "the ranks' engines differ"
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


def test_a_killed_worker_of_rank_1_under_fsdp_gets_the_kept_push_and_the_run_finishes(tmp_path):
    # the replacement is fed by rank 1 alone: re-sending the object store's last push needs no gather
    # (gathering the shards there would wait for rank 0, which never enters that collective)
    kill = ["--kill-worker-rank", "1", "--kill-at-step", "2", "--timeout-s", "60"]
    ranks = run_two_ranks(tmp_path, "async", 4, None, "fsdp", "--weight-sync", "object_store", *kill)
    check_sharding(ranks, "fsdp")
    restarts = [[step["worker_restarts"] for step in rank["steps"]] for rank in ranks]
    assert set(restarts[0]) == {0.0} and restarts[1][0] == 0.0 and restarts[1][-1] == 1.0, restarts
    for rank in ranks:
        assert len(rank["steps"]) == 4, "a step was not trained"
        staleness = [s["version"] - v for s in rank["steps"] for v in s["row_versions"]]
        assert 0 <= min(staleness) and max(staleness) <= 1
        assert rank["workers_equal"], "a rank's workers differ from its trainer at the end"
    assert ranks[0]["checksum"] == ranks[1]["checksum"]


def test_two_ranks_streaming_groups_lose_and_repeat_no_prompt_when_a_worker_of_rank_1_dies(tmp_path):
    """Group launches into a continuously batching engine, pushes without draining, on 2 DDP ranks;
    rank 1's worker SIGKILLed at step 2: its groups in flight are relaunched on the replacement, and
    across both ranks no prompt is trained twice, every trained row is within the bound, and both
    ranks' workers end on the trainer's weights."""
    kill = ["--kill-worker-rank", "1", "--kill-at-step", "2"]
    ranks = run_two_ranks(tmp_path, "async", 5, None, "ddp", "--streaming", *kill)
    restarts = [[step["worker_restarts"] for step in rank["steps"]] for rank in ranks]
    assert set(restarts[0]) == {0.0} and restarts[1][-1] == 1.0, restarts
    for rank in ranks:
        assert len(rank["steps"]) == 5
        staleness = [s["version"] - v for s in rank["steps"] for v in s["row_versions"]]
        assert 0 <= min(staleness) and max(staleness) <= 1, staleness
        trained = [g for s in rank["steps"] for g in s["gen_ids"]]
        assert len(trained) == len(set(trained)), "a group was trained twice"
        assert len(trained) == 5 * 4, "each step trains batch_size groups (one prompt per gen_id)"
        assert set(trained) | set(rank["evicted"]) | set(rank["untrained"]) <= set(range(rank["next_gen_id"]))
        assert rank["workers_equal"]
    trained = prompts(ranks)
    assert len(trained) == len(set(trained)), "a prompt was trained twice across ranks"
    assert ranks[0]["checksum"] == ranks[1]["checksum"]


def marked_processes(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``RUN_MARKER=marker``."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(RUN_MARKER) == marker and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.Error:  # gone, or another user's
            pass
    return found


def assert_nothing_left(marker: str) -> None:
    """Nothing of the run is left: ranks, Ray's head (gcs_server, raylet, agents), workers, watchdog."""
    deadline = time.monotonic() + 20
    while (left := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, [(p.pid, p.name()) for p in left]


def a_marker() -> str:
    marker = f"ddp-raise-{uuid.uuid4().hex}"
    probe = subprocess.Popen(["sleep", "60"], env={**os.environ, RUN_MARKER: marker})
    try:  # the check below can see a process of ours by its marker (once it has exec'd: before
        # that, /proc shows the parent's environment, so look again for a few seconds)
        deadline = time.monotonic() + 10
        while not (seen := [p.pid for p in marked_processes(marker)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert seen == [probe.pid]
    finally:
        probe.kill()
        probe.wait()
    return marker


ABORT_TIMEOUT_S = 60  # the strategy's default abort_timeout_s; the process group's timeout stays 1800 s


def test_an_exception_on_rank_1_ends_the_run_on_every_rank_within_the_deadline(tmp_path):
    marker = a_marker()
    fault = ["--raise-rank", "1", "--raise-at-step", "2"]
    done = launch(tmp_path, "sync", 6, None, "ddp", *fault, marker=marker)
    ended = time.time()
    assert done.returncode != 0
    assert "RuntimeError: injected failure on rank 1 at step 2" in done.stderr, done.stderr[-4000:]
    assert ended - float((tmp_path / "raised_at").read_text()) < ABORT_TIMEOUT_S, (
        "a rank outlived the deadline"
    )
    # the failing rank saved nothing and said so; the periodic last.ckpt (after step 1) stands
    assert "rank 1: no checkpoint saved after RuntimeError" in done.stderr
    assert "resume with --ckpt_path last" not in done.stderr
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 2
    assert_nothing_left(marker)


def test_a_reward_that_raises_in_rank_1s_worker_ends_every_rank_within_the_abort_timeout(tmp_path):
    """The reward runs in rank 1's rollout worker; rank 0 is then waiting in a collective (the
    process group's timeout is 1800 s) and is ended by the cross-rank abort, naming rank 1's error."""
    marker = a_marker()
    fault = ["--raise-reward-rank", "1", "--raise-at-call", "3"]
    done = launch(tmp_path, "sync", 8, None, "ddp", *fault, marker=marker)
    ended = time.time()
    assert done.returncode != 0
    assert "injected reward failure on rank 1 at call 3" in done.stderr, done.stderr[-4000:]
    assert "rank 0: ending the run, another rank failed: rank 1:" in done.stderr, done.stderr[-4000:]
    assert ended - float((tmp_path / "raised_at").read_text()) < ABORT_TIMEOUT_S, (
        "a rank outlived the deadline"
    )
    assert_nothing_left(marker)


def cli_two_ranks(out: Path, max_steps: int, reward: dict, marker: str) -> subprocess.CompletedProcess:
    """``unirl-lightning fit --config examples/grpo_tiny_ddp.yaml`` as a user runs it (Lightning's
    launcher starts rank 1 from the same command), with ``reward`` and a small model."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update({"RAY_AUTH_MODE": "token", RUN_MARKER: marker, "PYTHONPATH": str(ROOT)})
    command = [
        sys.executable,
        "-m",
        "unirl_lightning.cli",
        "fit",
        "--config",
        "examples/grpo_tiny_ddp.yaml",
    ]
    command += [f"--trainer.logger.init_args.save_dir={out}", f"--trainer.max_steps={max_steps}"]
    command += ["--trainer.enable_progress_bar=false"]
    command += ["--model.init_args.policy.init_args.hidden_size=32", "--model.init_args.num_generations=4"]
    command += ["--data.init_args.batch_size=4", f"--model.init_args.reward={json.dumps(reward)}"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


def test_from_the_cli_a_reward_raising_on_rank_1_ends_both_ranks_within_the_abort_timeout(tmp_path):
    """The recipe as shipped, from the CLI: rank 1's reward raises at its third call; both processes
    end within ``abort_timeout_s`` of it, with that error, and no process of the run is left."""
    marker = a_marker()
    reward = {
        "class_path": "tests.distributed.faults.FailingReward",
        "init_args": {"rank": 1, "at_call": 3, "out": str(tmp_path)},
    }
    done = cli_two_ranks(tmp_path / "runs", 20, reward, marker)
    ended = time.time()
    assert done.returncode != 0
    assert "injected reward failure on rank 1 at call 3" in done.stderr, done.stderr[-4000:]
    assert ended - float((tmp_path / "raised_at").read_text()) < ABORT_TIMEOUT_S, (
        "a rank outlived the deadline"
    )
    assert_nothing_left(marker)


def test_from_the_cli_a_reward_part_only_rank_1_has_is_logged(tmp_path):
    """Rank 1's reward has a part rank 0's lacks: the metric vector is the union of the ranks' keys, so
    the run does not hang and rank 0's TensorBoard file has the part (rank 1's mean) at every step."""
    from unirl_lightning.cli.curves import read_scalars

    marker = a_marker()
    done = cli_two_ranks(tmp_path / "runs", 3, {"class_path": "tests.distributed.faults.RankOnePart"}, marker)
    assert done.returncode == 0, done.stderr[-4000:]
    (log_dir,) = (tmp_path / "runs" / "grpo_tiny_ddp").glob("version_*")
    scalars = read_scalars(log_dir)
    assert [step for step, _ in scalars["rollout/reward/rank1_only_mean"]] == [1, 2, 3]
    assert [step for step, _ in scalars["rollout/reward/exact_match_mean"]] == [1, 2, 3]
    assert_nothing_left(marker)
