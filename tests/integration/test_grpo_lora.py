"""LoRA for LLM policies: only adapters train and travel; the workers then compute with the trainer's
merged weights."""

from __future__ import annotations

import pytest
import torch

from tests.builders import fit_tiny, tiny_module
from unirl_lightning.models.lora import LoraSpec, effective_weights
from unirl_lightning.strategy import AsyncRolloutStrategy

pytestmark = pytest.mark.usefixtures("ray_local")


def test_lora_push_is_adapter_only_and_workers_match_the_merged_trainer(tmp_path):
    full_bytes = sum(v.numel() * v.element_size() for v in tiny_module().policy.state_dict().values())
    strategy = AsyncRolloutStrategy(max_staleness=1, max_inflight=2)
    module = tiny_module(lora=LoraSpec(rank=2, alpha=4), lr=1e-2, kl_coef=0.01)
    try:
        trainer, module, recorder = fit_tiny(tmp_path, max_steps=3, strategy=strategy, module=module)
        assert 0 < strategy.last_sync["sync/bytes"] < 0.25 * full_bytes
        merged = effective_weights(module.policy)
        (worker,) = strategy.runtime.workers.call("state_dict")
        assert worker.keys() == merged.keys()
        changed = [
            k
            for k in merged
            if "lora" not in k and not torch.equal(merged[k], tiny_module().policy.state_dict()[k])
        ]
        assert changed, "training the adapters should move the merged weights"
        for name, tensor in merged.items():
            assert torch.allclose(worker[name], tensor, atol=1e-6), (
                f"worker's merged {name} differs from the trainer's"
            )
        assert all("train/kl" in s["metrics"] for s in recorder.steps)
    finally:
        strategy.shutdown()
