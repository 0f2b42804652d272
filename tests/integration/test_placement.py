"""Rollout-worker placement on a real Ray of two nodes that declare GPUs they do not have.

The cluster is this test's own (its own temp folder and ports, stopped by process id): a head node
standing for an 8-GPU training node whose trainer holds ``cuda:0..3`` under
``CUDA_VISIBLE_DEVICES=7,6,5,4,3,2,1,0`` (so Ray is started on the spare GPUs ``3,2,1,0`` that
:func:`local_ray_gpus` computes), and a second node on the same machine with 4 GPUs and the custom
resource ``rollout_node``. The Ray driver runs in a subprocess (``placement_driver.py``), so this
process's own Ray (the `ray_local` fixture of other tests), if any, is left alone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.integration.placement_driver import TRAINER_VISIBLE
from unirl_lightning.workers.placement import local_ray_gpus

pytestmark = pytest.mark.slow

TRAINER_DEVICES = [f"cuda:{k}" for k in range(4)]
TRAINER_GPU_IDS = {"7", "6", "5", "4"}  # cuda:0..3 under CUDA_VISIBLE_DEVICES=7,6,5,4,...
SPARE = local_ray_gpus(TRAINER_DEVICES, 4, TRAINER_VISIBLE)  # what the head's Ray is started with


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ports(*names: str) -> list[str]:
    return [f"--{name}={_free_port()}" for name in names]


def _ray_cli() -> str:
    here = Path(sys.executable).with_name("ray")
    return str(here) if here.exists() else (shutil.which("ray") or "ray")


def _start(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """``ray start --block ...`` in a process group of its own: it lives until we signal its pid."""
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [
                _ray_cli(),
                "start",
                "--block",
                "--disable-usage-stats",
                "--object-store-memory=80000000",
                *args,
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"the test's Ray head did not listen on {port} within {timeout_s} s")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to ``ray start --block`` (it drains the node and stops what it started), then SIGKILL
    to whatever of it is left: its process group and every descendant it had."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        family = []
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group is this node's alone (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass
    for child in family:  # worker processes run in groups of their own
        try:
            child.kill()
        except psutil.Error:
            pass
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def placement_results():
    temp_dir = tempfile.mkdtemp(prefix="rpl-")  # short: Ray's socket paths must stay under 108 bytes
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "CUDA_VISIBLE_DEVICES")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=uuid.uuid4().hex, RAY_USAGE_STATS_ENABLED="0")
    port = _free_port()
    started = []
    try:
        head_env = dict(env, CUDA_VISIBLE_DEVICES=",".join(SPARE))
        head_args = ["--head", f"--port={port}", f"--temp-dir={temp_dir}", "--include-dashboard=false"]
        head_args += ["--num-cpus=4", f"--num-gpus={len(SPARE)}"]
        head_args += _ports(
            "ray-client-server-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port"
        )
        head_args += _ports("runtime-env-agent-port", "metrics-export-port")
        started.append(_start(head_args, head_env, Path(temp_dir) / "head.log"))
        _wait_port(port, started[0])
        node_env = dict(env, CUDA_VISIBLE_DEVICES="0,1,2,3")
        node_args = [f"--address=127.0.0.1:{port}", f"--temp-dir={temp_dir}", "--num-cpus=2", "--num-gpus=4"]
        node_args += ["--resources", json.dumps({"rollout_node": 4})]
        node_args += _ports("dashboard-agent-listen-port", "dashboard-agent-grpc-port")
        node_args += _ports("runtime-env-agent-port", "metrics-export-port")
        started.append(_start(node_args, node_env, Path(temp_dir) / "node.log"))
        driver = Path(__file__).with_name("placement_driver.py")
        report = Path(temp_dir) / "report"
        out = subprocess.run(
            [sys.executable, str(driver), f"127.0.0.1:{port}", str(report)],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            cwd=Path(__file__).resolve().parents[2],
        )
        if out.returncode != 0:
            raise RuntimeError(f"the placement driver failed ({out.returncode}):\n{out.stderr[-4000:]}")
        results = json.loads(out.stdout.strip().splitlines()[-1])
        results["placement_json"] = json.loads((report / "placement.json").read_text())
        yield results
    finally:
        for proc in reversed(started):  # the worker node first, while the head still answers it
            _stop(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _scenario(results: dict, name: str) -> dict:
    result = results[name]
    assert "error" not in result, result.get("traceback")
    return result


def test_workers_on_the_training_node_get_distinct_spare_gpus(placement_results):
    result = _scenario(placement_results, "spare_gpus_on_the_training_node")
    workers = result["workers"]
    ids = [w["gpu_ids"] for w in workers]
    assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == 4  # distinct
    assert {i[0] for i in ids} == set(SPARE) == {"0", "1", "2", "3"}
    assert not {i[0] for i in ids} & TRAINER_GPU_IDS  # never a trainer's GPU
    assert all(w["cuda_visible_devices"] == w["gpu_ids"][0] for w in workers)  # the actor sees only its own
    assert {w["node_id"] for w in workers} == {placement_results["nodes"]["head"]}
    assert len({w["placement_group"] for w in workers}) == 4  # one placement group per worker
    saved = placement_results["placement_json"]
    assert saved["overlaps"] == [] and [t["gpu_ids"] for t in saved["trainers"]] == [
        ["7"],
        ["6"],
        ["5"],
        ["4"],
    ]
    assert "no GPU is shared" in result["table"] and len(result["table"].splitlines()) == 10


def test_a_tensor_parallel_worker_has_its_gpus_on_one_node(placement_results):
    result = _scenario(placement_results, "tensor_parallel_two")
    for group, children, actor in zip(result["groups"], result["children"], result["actors"]):
        assert actor["gpu_ids"] == [] and actor["placement_group"] == group  # the actor holds no GPU
        assert children["captured"]["placement_group"] == group  # child tasks stay in the group
        bundles = children["bundles"]
        assert {c["placement_group"] for c in bundles} == {group}
        assert len({c["node_id"] for c in bundles}) == 1  # STRICT_PACK: one node
        assert len({c["gpu_ids"][0] for c in bundles}) == 2  # one GPU per bundle
        assert children["captured"]["gpu_ids"][0] in {c["gpu_ids"][0] for c in bundles}
    gpus = [c["gpu_ids"][0] for children in result["children"] for c in children["bundles"]]
    assert sorted(gpus) == sorted(SPARE)  # no GPU given twice, never a trainer's
    whole = result["whole"]  # layout "actor": one bundle, the actor sees both GPUs
    assert len(whole["gpu_ids"]) == 2 and whole["cuda_visible_devices"].split(",") == whole["gpu_ids"]


def test_a_tensor_parallel_vllm_engine_gets_the_executor_its_layout_can_place(placement_results):
    """TP=2 inside a placement group, where vLLM would pick its Ray executor by itself: under the actor
    layout (one two-GPU bundle, which that executor refuses: "Placement group bundle cannot have more
    than 1 GPU") the engine runs vLLM's own processes ("mp"); per GPU, vLLM's Ray executor on the bundles."""
    args = _scenario(placement_results, "tensor_parallel_two")["engine_args"]
    assert args["actor"] == {
        "in_placement_group": True,
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "mp",
    }
    assert args["per_gpu"] == {
        "in_placement_group": True,
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "ray",
    }


def test_worker_resources_route_workers_to_the_rollout_node(placement_results):
    workers = _scenario(placement_results, "rollout_node_label")["workers"]
    assert {w["node_id"] for w in workers} == {placement_results["nodes"]["rollout"]}
    assert len({w["gpu_ids"][0] for w in workers}) == 3


def test_an_unsatisfiable_placement_fails_within_its_deadline_with_the_numbers(placement_results):
    result = _scenario(placement_results, "unsatisfiable_fails_in_time")
    assert 3 <= result["elapsed_s"] < 8, result["elapsed_s"]
    message = result["message"]
    assert "1 of 1 rollout worker placement group(s)" in message and "timeout_s=3" in message
    assert "{'GPU': 1.0}" in message and "STRICT_PACK" in message  # what was asked
    assert "'GPU': 8.0" in message and "per_node" in message  # what Ray has free
    assert "PENDING" not in result["states"]  # removed, not left waiting
    assert result["free_gpus"] == 8.0


def test_the_pre_check_compares_with_free_resources(placement_results):
    result = _scenario(placement_results, "precheck_against_free")
    assert result["elapsed_s"] < 2
    assert "3 rollout worker(s) need GPU=12 (free 8)" in result["first"]
    assert "5 rollout worker(s) need GPU=5 (free 4)" in result["second"]  # 4 held by another actor


def _assert_a_worker_group_on_spare_gpus(result: dict) -> None:
    """Distinct spare GPUs, none a trainer's, a placement group each; worker 0's replacement runs in
    worker 0's group (on the same GPU); shutdown removes the groups."""
    ids = [w["gpu_ids"] for w in result["before"]]
    assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == len(ids) == 2
    assert {i[0] for i in ids} <= set(SPARE) and not {i[0] for i in ids} & TRAINER_GPU_IDS
    assert [w["worker"] for w in result["before"]] == [0, 1]
    assert [w["placement_group"] for w in result["before"]] == result["groups"]
    assert all(w["cuda_visible_devices"] == w["gpu_ids"][0] for w in result["before"])
    replaced, kept = result["after"]
    assert result["restarts"] == 1 and replaced["pid"] != result["before"][0]["pid"]
    assert replaced["placement_group"] == result["groups"][0] and replaced["gpu_ids"] == ids[0]
    assert kept == result["before"][1]
    assert result["states"] == ["REMOVED", "REMOVED"]


def test_a_worker_group_gets_spare_gpus_and_a_replacement_keeps_its_group(placement_results):
    _assert_a_worker_group_on_spare_gpus(_scenario(placement_results, "worker_group_on_spare_gpus"))


def test_reward_workers_get_spare_gpus_no_trainer_and_no_rollout_worker_holds(placement_results):
    result = _scenario(placement_results, "reward_workers_beside_rollout_workers")
    saved = result["saved"]
    rollout = [g for w in saved["workers"] for g in w["gpu_ids"]]
    reward = [g for w in saved["reward_workers"] for g in w["gpu_ids"]]
    assert len(rollout) == len(reward) == 2 and len(set(rollout + reward)) == 4  # four distinct GPUs
    assert set(rollout + reward) == set(SPARE) and not set(reward) & TRAINER_GPU_IDS
    assert [w["reward_worker"] for w in saved["reward_workers"]] == [0, 1]
    assert len({w["placement_group"] for w in saved["reward_workers"] + saved["workers"]}) == 4
    assert all(w["cuda_visible_devices"] == w["gpu_ids"][0] for w in saved["reward_workers"])
    assert saved["overlaps"] == [] and "no GPU is shared" in result["table"]
    assert [line.split()[0] for line in result["table"].splitlines()[1:]].count("reward") == 2
    assert result["clash"] == [
        f"reward worker 0 shares GPU 7 on {saved['reward_workers'][0]['node_ip']} with training rank 0"
    ]


def test_a_local_ray_started_for_gpu_trainers_has_only_their_spare_gpus():
    """The run's own path (``ensure_ray`` with the training devices): the local Ray sees only the GPUs
    ``cuda:0..3`` of ``CUDA_VISIBLE_DEVICES=7,...,0`` leave, and too large an ask fails before it starts."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(CUDA_VISIBLE_DEVICES=TRAINER_VISIBLE, RAY_USAGE_STATS_ENABLED="0")
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("placement_driver.py")), "--local"],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "error" not in result, result.get("traceback")
    assert "ask for 5 GPU(s) but only 4 of the 8 visible" in result["too_many"]
    assert not result["started_on_error"]
    assert result["ray_gpus"] == 4.0 and result["cuda_visible_devices"] == TRAINER_VISIBLE
    _assert_a_worker_group_on_spare_gpus(result)


def test_the_pre_check_waits_for_resources_a_stopped_run_is_returning(ray_local):
    """A killed actor's CPUs come back a moment after the kill: a fit started then (a notebook's second
    ``fit``) waits for them instead of failing; an ask larger than the whole cluster fails at once."""
    import threading

    from unirl_lightning.workers.placement import PlacementError, check_free

    total = ray_local.cluster_resources()["CPU"]
    holder = ray_local.remote(num_cpus=total - 1)(_Holder).remote()
    ray_local.get(holder.ready.remote())
    assert ray_local.available_resources().get("CPU", 0.0) < 2
    threading.Timer(1.5, lambda: ray_local.kill(holder)).start()
    start = time.monotonic()
    check_free(2, [{"CPU": 1.0}])
    assert 1.0 < time.monotonic() - start < 10
    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"need CPU=%g \(free " % (total + 1)):
        check_free(int(total) + 1, [{"CPU": 1.0}])
    assert time.monotonic() - start < 1


class _Holder:
    def ready(self) -> bool:
        return True
