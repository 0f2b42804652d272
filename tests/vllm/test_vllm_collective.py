"""The collective weight-sync backend into a real (CPU) vLLM, over gloo: the member of the group is
the code in vLLM's worker process (the worker extension, joined through ``collective_rpc``), so a
push lands there without a host copy or a msgpack of tensors. Checked with vLLM's engine core in its
own process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, vLLM's default and the GPU setup) and in the
rollout worker's process (``=0``): the received bytes equal the trainer's, the tensors vLLM keeps as
sent are bit-identical to the trainer's, greedy outputs and log-probs follow the pushed weights, and
the receiving pid is vLLM's worker's."""

from __future__ import annotations

import hashlib
import os

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm runs these in .venv-vllm)")

import torch  # noqa: E402

from tests.vllm.helpers import max_logprob_gap, records, tiny_policy  # noqa: E402
from unirl_lightning.engines.hf import HFEngineConfig  # noqa: E402
from unirl_lightning.engines.vllm import VLLMEngineConfig  # noqa: E402
from unirl_lightning.models.lora import LoraSpec  # noqa: E402
from unirl_lightning.rollout.records import RolloutRequest, SamplingParams  # noqa: E402
from unirl_lightning.weight_sync import CollectiveWeightSync  # noqa: E402
from unirl_lightning.weight_sync.base import weight_tensors  # noqa: E402


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(
        tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    ).hexdigest()


def greedy(workers, max_new_tokens: int = 12) -> list[list[int]]:
    request = RolloutRequest(
        records(), n=1, sampling=SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
    )
    groups = workers.generate(request).result().groups
    return [group[0].completion_ids for group in groups]


def record_digests(worker) -> None:
    worker.engine.record_digests = True


def receipt(worker, shapes: dict[str, list[int]]) -> dict:
    engine = worker.engine
    return {
        "actor_pid": os.getpid(),
        "in_process": type(engine.llm.llm_engine.engine_core).__name__ == "InprocClient",
        "join_pids": engine.weight_group_pids,
        "last_receive": engine.last_receive,
        "params": engine.llm.collective_rpc("unirl_param_digests", args=(shapes,))[0],
        "weight_version": engine.weight_version,
    }


def worker_group(multiprocessing: str, lora: LoraSpec | None = None, policy=None):
    from unirl_lightning.workers import RolloutWorkerGroup

    return RolloutWorkerGroup(
        VLLMEngineConfig(bucket_mb=0.01),  # ~one layer per vLLM bucket; the broadcast has its own buckets
        policy or tiny_policy(),
        lora,
        runtime_env={"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing}},
        start_timeout_s=300,
    )


@pytest.mark.parametrize("multiprocessing", ["1", "0"], ids=["engine-core-process", "in-process"])
def test_collective_push_is_received_and_loaded_in_vllms_worker_process(multiprocessing, ray_local):
    workers = worker_group(multiprocessing)
    sync = CollectiveWeightSync(bucket_mb=0.005, timeout_s=120, backend="gloo")  # several buckets
    try:
        ray_local.get(workers.workers[0].run.remote(record_digests))
        for version, seed in ((1, 5), (2, 6)):  # a second push over the same group
            model, _ = tiny_policy(seed=seed).build()
            sync.push(model, workers, weight_version=version)
            sent = weight_tensors(model)
            # the embedding and the norms, as vLLM holds them (its linear layers are fused, and on
            # CPU repacked); the embedding's leading rows (vLLM pads its rows to a multiple of 64)
            kept = {name: t for name, t in sent.items() if "norm" in name or "embed_tokens" in name}
            assert "model.embed_tokens.weight" in kept and len(kept) > 2
            shapes = {name: list(t.shape) for name, t in kept.items()}
            info = ray_local.get(workers.workers[0].run.remote(receipt, shapes))
            assert info["in_process"] == (multiprocessing == "0")
            assert info["weight_version"] == version
            (result,) = info["last_receive"]  # one vLLM worker
            assert result["tensors"] == len(sent)
            assert len(result["pids"]) > 1, "expected several buckets"
            # the receiving side is vLLM's worker process: its own when the engine core is separate
            assert set(result["pids"]) == set(info["join_pids"])
            if multiprocessing == "1":
                assert info["actor_pid"] not in result["pids"]
            else:
                assert set(result["pids"]) == {info["actor_pid"]}
            # bit-identical: every received tensor, and every tensor vLLM keeps as the trainer sent it
            assert result["digests"] == {name: digest(t) for name, t in sent.items()}
            assert set(info["params"]) == set(kept)
            for name, tensor in kept.items():
                held, dtype, shape = info["params"][name]
                assert (dtype, shape) == (str(tensor.dtype).removeprefix("torch."), list(tensor.shape)), name
                assert held == digest(tensor), f"{name} differs from the trainer's"
            # and the engine generates with them
            assert greedy(workers) == greedy_hf(seed)
            sampled = (
                workers.generate(
                    RolloutRequest(records(), n=2, sampling=SamplingParams(max_new_tokens=8), seed=1)
                )
                .result()
                .groups
            )
            assert {r.weight_version for g in sampled for r in g} == {version}
            assert max_logprob_gap(model, sampled, 1.0) < 1e-4
    finally:
        sync.close()
        workers.shutdown()


def greedy_hf(seed: int) -> list[list[int]]:
    from tests.vllm.helpers import greedy_completions

    return greedy_completions(HFEngineConfig().build(tiny_policy(seed=seed)))


def test_collective_lora_push_is_relayed_through_the_engine(ray_local):
    """Adapters are loaded from files by the engine, so under LoRA the rollout worker's process is
    the group member and hands each adapter push to ``load_weights``."""
    from tests.vllm.test_vllm_weight_push import lora_policy

    lora = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    workers = worker_group("0", lora)
    sync = CollectiveWeightSync(timeout_s=120, backend="gloo")
    try:
        base = greedy(workers)
        peft_model = lora_policy(lora, scale=0.3, seed=0)
        sync.push(peft_model, workers, weight_version=1)
        assert ray_local.get(workers.workers[0].weight_version.remote()) == 1
        hf = HFEngineConfig().build(tiny_policy())
        hf.model.load_state_dict(peft_model.merge_and_unload().state_dict())
        from tests.vllm.helpers import greedy_completions

        pushed = greedy(workers)
        assert pushed == greedy_completions(hf)
        assert pushed != base
    finally:
        sync.close()
        workers.shutdown()


@pytest.mark.slow
def test_cli_collective_on_policy_pin_with_vllms_engine_core_process(tmp_path):
    """The tiny GRPO recipe from the CLI on vLLM with the collective backend and the engine core in
    its own process, on-policy (max_staleness 0): every step's importance ratio is 1 and the engine's
    log-probs equal the trainer's, so each push reached the weights vLLM generates with."""
    import subprocess
    import sys
    from pathlib import Path

    from unirl_lightning.cli.curves import read_scalars

    recipe = Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny.yaml"
    strategy = "--trainer.strategy.init_args."
    args = [sys.executable, "-m", "unirl_lightning.cli", "fit", "--config", str(recipe)]
    args += [f"{strategy}engine", "vllm", f"{strategy}weight_sync", "collective"]
    args += [f"{strategy}max_staleness", "0", f"{strategy}max_inflight", "1", "--trainer.max_steps", "8"]
    args += ["--trainer.logger.init_args.save_dir", str(tmp_path)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    scalars = read_scalars(tmp_path)
    ratios = [value for _, value in scalars["train/ratio_mean"]]
    diffs = [value for _, value in scalars["train/logp_diff_abs"]]
    assert len(ratios) == 8 and len(scalars["sync/time_s"]) == 8
    assert max(abs(r - 1) for r in ratios) < 1e-3, ratios
    assert max(diffs) < 1e-4, diffs


def relay_full_weights(worker) -> None:
    """Make this process the group's member for full weights (as with several vLLM workers, which CPU
    cannot run): each push is then relayed into vLLM by this process."""
    worker.engine._worker_is_member = lambda: False


def relayed(worker) -> dict:
    engine = worker.engine
    return {"loads": engine.relayed_loads, "weight_version": engine.weight_version}


@pytest.mark.parametrize("multiprocessing", ["1", "0"], ids=["engine-core-process", "in-process"])
def test_a_relayed_full_push_goes_into_vllm_bucket_by_bucket(multiprocessing, ray_local):
    """The relay (LoRA, or tensor parallelism) loads each received bucket into vLLM before it receives
    the next, so it never holds the model (a 7B model would add 15 GB to a GPU already filled): every
    load is at most one broadcast bucket or one layer, whichever is larger (vLLM loads layers whole, so
    a layer split across buckets is carried to the next), there are several, and the engine then
    generates with the pushed weights."""
    from unirl_lightning.weight_sync.buckets import layer_of

    workers = worker_group(multiprocessing)
    bucket_mb = 0.005
    sync = CollectiveWeightSync(bucket_mb=bucket_mb, timeout_s=120, backend="gloo")
    try:
        ray_local.get(workers.workers[0].run.remote(relay_full_weights))
        model, _ = tiny_policy(seed=5).build()
        sync.push(model, workers, weight_version=1)
        info = ray_local.get(workers.workers[0].run.remote(relayed))
        sent = weight_tensors(model)
        layers: dict[str, int] = {}
        for name, t in sent.items():
            layers[layer_of(name, True)] = layers.get(layer_of(name, True), 0) + t.numel() * t.element_size()
        largest_tensor = max(t.numel() * t.element_size() for t in sent.values())
        total = sum(layers.values())
        assert info["weight_version"] == 1
        assert len(info["loads"]) > 2, info["loads"]
        assert sum(info["loads"]) == total  # every weight once
        assert max(info["loads"]) <= max(bucket_mb * 1024**2 + largest_tensor, max(layers.values())), info[
            "loads"
        ]
        assert max(info["loads"]) < total / 2
        assert greedy(workers) == greedy_hf(5)
    finally:
        sync.close()
        workers.shutdown()
