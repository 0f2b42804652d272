"""The Ray driver of ``test_placement.py``: joins the test's cluster (two nodes that declare GPUs they
do not have), runs the placement scenarios one after the other and prints their results as one JSON
object. A scenario that raises reports ``{"error": ..., "traceback": ...}``.

Run as ``python placement_driver.py <address> <report_folder>`` (the test does), or as
``python placement_driver.py --local`` to start a local Ray the way a run does (:func:`ensure_ray` for
training ranks on ``cuda:0..3`` under ``CUDA_VISIBLE_DEVICES=7,6,...,0``) and place a worker group in it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from unirl_lightning.workers.cluster import ensure_ray, shutdown_ray_if_owned
from unirl_lightning.workers.group import RolloutWorkerGroup
from unirl_lightning.workers.placement import (
    PlacementError,
    PlacementProbe,
    place_workers,
    placement_report,
    probe_task,
    trainer_placement_info,
    visible_gpu_ids,
)

TRAINER_VISIBLE = "7,6,5,4,3,2,1,0"  # the training node's CUDA_VISIBLE_DEVICES; its ranks hold cuda:0..3
TOTAL_GPUS = 8.0  # 4 spare GPUs on the head (the training node) + 4 on the rollout node


class FakeEngine:
    """Stands for an engine in a real rollout worker (placement needs no model)."""

    weight_version = 0

    def close(self) -> None:
        pass


class FakeEngineConfig:
    def build(self, policy: Any, lora: Any = None) -> FakeEngine:
        return FakeEngine()


@ray.remote(num_cpus=0)
class Probe(PlacementProbe):
    def child_info(self, bundles: int) -> dict[str, Any]:
        """Where one-GPU tasks started by this actor land: one with no strategy of its own (captured
        into the actor's placement group, or not) and one in each GPU bundle ``1..bundles-1`` and
        ``0`` of the actor's group, the way vLLM's Ray executor places its tensor-parallel ranks."""
        group = ray.util.get_current_placement_group()
        captured = probe_task.options(num_gpus=1).remote()
        per_bundle = [
            probe_task.options(
                num_gpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)
            ).remote()
            for i in range(bundles)
        ]
        return {"captured": ray.get(captured, timeout=60), "bundles": ray.get(per_bundle, timeout=60)}

    def vllm_engine_args(self, layout: str, gpus: int) -> dict[str, Any]:
        """The vLLM engine arguments a worker of ``layout`` builds in this actor (no vLLM needed), and
        whether the actor sits in a placement group (where vLLM's default executor is its Ray one)."""
        from types import SimpleNamespace

        from unirl_lightning.engines.serving import ServedPolicy
        from unirl_lightning.engines.vllm import VLLMEngineConfig
        from unirl_lightning.engines.vllm_args import vllm_engine_kwargs

        settings = SimpleNamespace(
            placement="separate",
            shares_trainer_device=False,
            in_process=False,
            num_gpus_per_worker=gpus,
            worker_layout=layout,
        )
        config = VLLMEngineConfig().for_placement(settings)
        kwargs = vllm_engine_kwargs(config, ServedPolicy("/m", "bfloat16", False, None), False, None, False)
        return {
            "in_placement_group": ray.util.get_current_placement_group() is not None,
            "tensor_parallel_size": kwargs["tensor_parallel_size"],
            "distributed_executor_backend": kwargs.get("distributed_executor_backend"),
        }


def start_probes(placement) -> list[Any]:
    """One probe actor per worker, with the worker's actor options."""
    return [Probe.options(**opts).remote() for opts in placement.options]


def probe_tasks(placement) -> list[dict[str, Any]]:
    """Where each worker would run: a task with the worker's options (the same resources and
    placement group bundle as its actor). One after the other, so that they reuse one pooled
    process instead of starting one each (slow on a busy machine); the groups' reservations keep
    the GPUs apart all the same."""
    return [ray.get(probe_task.options(**opts).remote(), timeout=60) for opts in placement.options]


def wait_idle(timeout_s: float = 20.0) -> None:
    """Until every GPU is free again (removing placement groups and killing actors is asynchronous)."""
    deadline, total = time.monotonic() + timeout_s, ray.cluster_resources().get("GPU", 0.0)
    while ray.available_resources().get("GPU", 0.0) < total and time.monotonic() < deadline:
        time.sleep(0.1)


def cleanup(placement, actors) -> None:
    for actor in actors:
        ray.kill(actor)
    placement.remove()
    wait_idle()


def node_ids() -> dict[str, str]:
    """``{"head": id, "rollout": id}`` of the two alive nodes."""
    ids = {}
    for node in ray.nodes():
        if node["Alive"]:
            ids["rollout" if "rollout_node" in node["Resources"] else "head"] = node["NodeID"]
    return ids


def spare_gpus_on_the_training_node(folder: str) -> dict[str, Any]:
    """4 one-GPU workers pinned to the head: distinct GPU ids, none a trainer's; and the report."""
    placement = place_workers(4, 0.5, 1, {"node:__internal_head__": 0.01}, timeout_s=30)
    infos = probe_tasks(placement)
    visible = visible_gpu_ids(TRAINER_VISIBLE)
    ip = infos[0]["node_ip"]
    trainers = [trainer_placement_info(r, f"cuda:{r}", visible, node_ip=ip) for r in range(4)]
    workers = [{"worker": i, **info} for i, info in enumerate(infos)]
    table = placement_report(trainers, workers, folder)
    cleanup(placement, [])
    return {"workers": infos, "trainers": trainers, "table": table}


def tensor_parallel_two(folder: str) -> dict[str, Any]:
    """TP=2 workers: per-GPU bundles (STRICT_PACK) filled by the actor's child tasks, and one
    two-GPU bundle (on the head, whose pooled worker processes start tasks at once)."""
    head = {"node:__internal_head__": 0.01}
    placement = place_workers(2, 0.5, 2, head, layout="per_gpu", timeout_s=30)
    actors = start_probes(placement)
    actor_infos = ray.get([a.info.remote() for a in actors], timeout=60)
    children = ray.get([a.child_info.remote(2) for a in actors], timeout=60)
    engine_args = {"per_gpu": ray.get(actors[0].vllm_engine_args.remote("per_gpu", 2), timeout=60)}
    groups = [g.id.hex() for g in placement.groups]
    cleanup(placement, actors)
    whole = place_workers(1, 0.5, 2, head, timeout_s=30)  # layout "actor": the actor holds both GPUs
    actors = start_probes(whole)
    whole_info = ray.get(actors[0].info.remote(), timeout=60)
    engine_args["actor"] = ray.get(actors[0].vllm_engine_args.remote("actor", 2), timeout=60)
    cleanup(whole, actors)
    return {
        "actors": actor_infos,
        "children": children,
        "groups": groups,
        "whole": whole_info,
        "engine_args": engine_args,
    }


def rollout_node_label(folder: str) -> dict[str, Any]:
    placement = place_workers(3, 0.25, 1, {"rollout_node": 1}, timeout_s=30)
    infos = probe_tasks(placement)
    cleanup(placement, [])
    return {"workers": infos}


def unsatisfiable_fails_in_time(folder: str) -> dict[str, Any]:
    """6 GPUs on one node: 8 are free in all, so the pre-check passes, but no node has 6."""
    start = time.monotonic()
    try:
        place_workers(1, 0, 6, layout="per_gpu", timeout_s=3)
        raise AssertionError("a TP=6 worker was placed on nodes of 4 GPUs")
    except PlacementError as exc:
        message, elapsed = str(exc), time.monotonic() - start
    wait_idle()
    states = [t["state"] for t in ray.util.placement_group_table().values()]
    return {
        "message": message,
        "elapsed_s": elapsed,
        "states": states,
        "free_gpus": ray.available_resources().get("GPU"),
    }


def precheck_against_free(folder: str) -> dict[str, Any]:
    """12 GPUs asked, 8 free: an error at once; then 4 GPUs held by others leave 4 free for 5 asked."""
    start = time.monotonic()
    try:
        place_workers(3, 0, 4, timeout_s=30)
        raise AssertionError("12 GPUs were placed on 8")
    except PlacementError as exc:
        first, elapsed = str(exc), time.monotonic() - start
    holder = place_workers(1, 0, 4, {"rollout_node": 1}, timeout_s=30)  # reserved, unused
    try:
        place_workers(5, 0, 1, timeout_s=30)
        raise AssertionError("5 GPUs were placed on 4 free")
    except PlacementError as exc:
        second = str(exc)
    cleanup(holder, [])
    return {"first": first, "elapsed_s": elapsed, "second": second}


def worker_group(folder: str, num_workers: int = 2, **resources: Any) -> dict[str, Any]:
    """A real :class:`RolloutWorkerGroup` of one-GPU workers: where they run, where worker 0's
    replacement runs, and the state of their placement groups after shutdown."""
    group = RolloutWorkerGroup(
        FakeEngineConfig(),
        None,
        num_workers=num_workers,
        num_cpus_per_worker=0.25,
        num_gpus_per_worker=1,
        resources_per_worker=resources or None,
        start_timeout_s=60,
    )
    groups = [g.id.hex() for g in group._placement.groups]
    before = group.call("placement_info", timeout_s=60)
    group.replace(0, group.workers[0], "was replaced by the test")
    after = group.call("placement_info", timeout_s=60)
    group.shutdown()
    wait_idle()
    table = ray.util.placement_group_table()
    states = [table.get(g, {}).get("state") for g in groups]
    return {"groups": groups, "before": before, "after": after, "states": states, "restarts": group.restarts}


def reward_workers_beside_rollout_workers(folder: str) -> dict[str, Any]:
    """Two one-GPU rollout workers and two one-GPU reward workers on the training node (4 spare GPUs),
    the placement report written as a run writes it (``placement.json`` with ``reward_workers``)."""
    from unirl_lightning.rewards import ExactMatchReward
    from unirl_lightning.runtime import RewardWorkers
    from unirl_lightning.workers.reward import RewardWorkerPool

    head = {"node:__internal_head__": 0.01}
    settings = RewardWorkers(
        num_workers=2, num_cpus_per_worker=0.25, num_gpus_per_worker=1, resources_per_worker=head
    )
    pool = RewardWorkerPool(ExactMatchReward(), settings, start_timeout_s=60)
    group = RolloutWorkerGroup(
        FakeEngineConfig(), None, num_workers=2, num_cpus_per_worker=0.25, num_gpus_per_worker=1,
        resources_per_worker=head, start_timeout_s=60, reward_pool=pool,
    )  # fmt: skip
    try:
        workers = group.call("placement_info", timeout_s=60)
        scorers = pool.call("placement_info", timeout_s=60)
        visible = visible_gpu_ids(TRAINER_VISIBLE)
        trainers = [
            trainer_placement_info(r, f"cuda:{r}", visible, node_ip=workers[0]["node_ip"]) for r in range(4)
        ]
        report = os.path.join(folder, "reward")
        table = placement_report(trainers, workers, report, scorers)
        with open(os.path.join(report, "placement.json")) as f:
            saved = json.load(f)
        clash = [{**scorers[0], "gpu_ids": ["7"]}]  # as if Ray had handed out a trainer's GPU
        from unirl_lightning.workers.placement import find_overlaps

        return {"saved": saved, "table": table, "clash": find_overlaps(trainers, [], clash)}
    finally:
        group.shutdown()
        pool.shutdown()
        wait_idle()


def worker_group_on_spare_gpus(folder: str) -> dict[str, Any]:
    """Two one-GPU workers pinned to the training node (its Ray has only the spare GPUs)."""
    return worker_group(folder, **{"node:__internal_head__": 0.01})


SCENARIOS = [
    spare_gpus_on_the_training_node,
    tensor_parallel_two,
    rollout_node_label,
    unsatisfiable_fails_in_time,
    precheck_against_free,
    worker_group_on_spare_gpus,
    reward_workers_beside_rollout_workers,
]


def main(address: str, folder: str) -> None:
    ray.init(address=address, log_to_driver=False)
    deadline = time.monotonic() + 60
    while len(node_ids()) < 2 or ray.available_resources().get("GPU", 0.0) < TOTAL_GPUS:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the test cluster did not come up: {ray.nodes()}")
        time.sleep(0.2)
    results: dict[str, Any] = {"nodes": node_ids()}
    for scenario in SCENARIOS:
        start = time.monotonic()
        try:
            results[scenario.__name__] = scenario(folder)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            results[scenario.__name__] = {"error": repr(exc), "traceback": traceback.format_exc()}
            wait_idle()
        results[scenario.__name__]["scenario_s"] = time.monotonic() - start
    print(json.dumps(results), flush=True)
    ray.shutdown()


def main_local() -> None:
    """A local Ray started for 4 training ranks on ``cuda:0..3`` of ``CUDA_VISIBLE_DEVICES=7,...,0``
    (the test sets it): too large an ask fails before Ray starts; then 2 one-GPU workers."""
    trainers = [f"cuda:{k}" for k in range(4)]
    try:
        ensure_ray(2, 80_000_000, trainers, asked_gpus=5)
        too_many = "ray started"
    except ValueError as exc:
        too_many = str(exc)
    started = ray.is_initialized()
    ensure_ray(2, 80_000_000, trainers, asked_gpus=2)
    results = {
        "too_many": too_many,
        "started_on_error": started,
        "ray_gpus": ray.cluster_resources().get("GPU"),
    }
    results["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")  # restored in the driver
    try:
        results.update(worker_group(""))
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
        results.update(error=repr(exc), traceback=traceback.format_exc())
    print(json.dumps(results), flush=True)
    shutdown_ray_if_owned()


if __name__ == "__main__":
    if sys.argv[1] == "--local":
        main_local()
    else:
        main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    os._exit(0)  # the interpreter's own exit after ray.shutdown() lingers 10-20 s on a busy machine
