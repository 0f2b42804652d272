"""The FSDP2 sibling's own rules (the 2-rank runs are in tests/integration/test_ddp.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.builders import tiny_module
from unirl_lightning.distributed.sharding import block_classes, full_tensor, local_numel
from unirl_lightning.models.lora import LoraSpec
from unirl_lightning.strategy import AsyncRolloutFSDPStrategy


def test_fsdp_refuses_a_module_it_cannot_shard_naming_the_alternatives():
    module = SimpleNamespace(rollout_spec=lambda: SimpleNamespace(family="diffusion", agentic=None))
    strategy = AsyncRolloutFSDPStrategy(max_staleness=0, max_inflight=1)
    with pytest.raises(
        ValueError, match="shards LLM modules.*AsyncRolloutStrategy or AsyncRolloutDDPStrategy"
    ):
        strategy.setup(SimpleNamespace(lightning_module=module))


def test_every_rank_gets_its_own_prompts(monkeypatch):
    """Lightning's ModelParallelStrategy hands out prompts per data-parallel group (its mesh's first
    dimension, one per node); here every rank is a replica with prompts of its own."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    monkeypatch.setenv("LOCAL_RANK", "1")
    strategy = AsyncRolloutFSDPStrategy()
    strategy.cluster_environment = LightningEnvironment()
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy.set_world_ranks()
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}


def test_the_blocks_found_are_the_transformer_layers_also_under_lora():
    plain = tiny_module()
    assert block_classes(plain.policy) == {"LlamaDecoderLayer"}
    lora = tiny_module(lora=LoraSpec(rank=4))
    assert block_classes(lora.policy) == {"LlamaDecoderLayer"}


def test_unsharded_tensors_pass_through_and_count_whole():
    module = tiny_module()
    weight = module.policy.lm_head.weight
    assert full_tensor(weight) is weight
    held, total = local_numel(module.policy)
    assert held == total == sum(p.numel() for p in module.policy.parameters())
