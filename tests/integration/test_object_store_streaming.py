"""A full push larger than the object store streams through it in buckets (its own Ray, in a
subprocess, with a store of 80 MB: Ray's minimum is 75 MB), and the worker's fallback for engines
that load whole pushes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import torch

from unirl_lightning.workers.actor import RolloutWorker

SCRIPT = textwrap.dedent(
    """
    import json, os, types
    import ray
    from unirl_lightning.engines.hf import HFEngineConfig
    from unirl_lightning.models.causal_lm import TinyCausalLM
    from unirl_lightning.weight_sync.object_store import ObjectStoreWeightSync
    from unirl_lightning.workers.actor import RolloutWorker

    ray.init(num_cpus=2, object_store_memory=80 * 1024**2, include_dashboard=False, log_to_driver=False,
             _temp_dir=os.environ["STREAM_TEST_RAY_DIR"])
    spec = dict(hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=4)
    Actor = ray.remote(num_cpus=0)(RolloutWorker)
    workers = types.SimpleNamespace(workers=[
        Actor.remote(HFEngineConfig(device="cpu", num_threads=1), TinyCausalLM(seed=0, **spec), None, None, i)
        for i in range(2)
    ])
    ray.get([w.weight_version.remote() for w in workers.workers])
    out = {"model_mb": 0.0, "pushes": []}
    for version, (bucket_mb, seed) in enumerate([(20, 1), (1024, 2), (20, 3)], start=1):
        model, _ = TinyCausalLM(seed=seed, **spec).build()
        sync = ObjectStoreWeightSync(timeout_s=300, bucket_mb=bucket_mb)
        stats = sync.push(model, workers, version)
        expected = model.state_dict()
        served = ray.get([w.state_dict.remote() for w in workers.workers])
        equal = all(all(s[n].equal(t) for n, t in expected.items()) for s in served)
        out["model_mb"] = stats.bytes / 1024**2
        out["pushes"].append({
            "bucket_mb": bucket_mb, "time_s": stats.time_s, "equal": equal,
            "versions": ray.get([w.weight_version.remote() for w in workers.workers]),
            "kept": sync.resend(workers, version) is not None,
        })
        sync.close()
    print("RESULT " + json.dumps(out))
    ray.shutdown()
    """
)


def test_a_push_larger_than_the_object_store_streams_in_buckets_bit_exact(tmp_path):
    ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay short
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT],
            env={**env, "STREAM_TEST_RAY_DIR": ray_dir},
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(line.removeprefix("RESULT "))
    print(out)  # the push times: streamed (20 MB buckets) vs one object larger than the store
    assert out["model_mb"] > 100, "the push must be larger than the 80 MB store"
    for push, version in zip(out["pushes"], (1, 2, 3)):
        assert push["equal"], push
        assert push["versions"] == [version, version]
        assert not push["kept"], "a push larger than a quarter of the store is not kept for resend"
        assert push["time_s"] < 120, push  # a sanity bound only


class _WholeOnlyEngine:
    """An engine without the bucketed API: it takes a whole push in one load_weights."""

    def __init__(self) -> None:
        self.weight_version = 0
        self.calls: list[tuple[dict[str, torch.Tensor], int]] = []

    def load_weights(self, named_tensors, weight_version):
        self.calls.append((dict(named_tensors), weight_version))
        self.weight_version = weight_version


class _Config:
    def build(self, policy, lora):
        return _WholeOnlyEngine()


def test_an_engine_without_bucketed_loading_gets_one_load_of_copied_buckets():
    worker = RolloutWorker(_Config(), None, None, None)
    source = {"a": torch.ones(2), "b": torch.zeros(3)}
    worker.begin_weight_push(4)
    worker.load_weight_bucket([("a", source["a"])])
    worker.load_weight_bucket({"b": source["b"]})
    assert worker.engine.calls == [] and worker.engine.weight_version == 0, "nothing served before the end"
    assert worker.finish_weight_push(4) == 4
    ((loaded, version),) = worker.engine.calls
    assert version == 4 and loaded.keys() == source.keys()
    assert all(loaded[n].equal(t) and loaded[n].data_ptr() != t.data_ptr() for n, t in source.items())
    # an interrupted push loads nothing and keeps the version
    worker.begin_weight_push(5)
    worker.load_weight_bucket([("a", source["a"])])
    assert worker.finish_weight_push(None) is None
    assert len(worker.engine.calls) == 1 and worker.engine.weight_version == 4
