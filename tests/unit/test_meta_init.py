"""Pins unirl_lightning.distributed.meta_init and ``load_once_per_node`` in one process: which launch environments
make a process a node-local rank > 0, that the specs' meta builds have their real builds' names,
shapes, dtypes and ties (LoRA wrapping and a PPO critic included) without values, that materializing
keeps tied weights tied, and that a meta-built module alone refuses to train naming the setting. The
2-rank fill is tests/integration/test_rank0_load.py."""

from __future__ import annotations

import pytest
import torch

from tests.builders import tiny_module
from tests.unit.real_model import needs_smollm2, smollm2_dir
from unirl_lightning.distributed.meta_init import (
    has_meta_tensors,
    launched_as_local_rank_above_zero,
    layout,
    layout_difference,
    materialize,
    node_local_rank,
    ranks_to_fill,
)
from unirl_lightning.models.causal_lm import PretrainedCausalLM, TinyCausalLM
from unirl_lightning.models.lora import LLM_LORA_TARGETS, LoraSpec, apply_lora
from unirl_lightning.modules import PPOModule

TINY = TinyCausalLM(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


@pytest.mark.parametrize(
    "environ, found, above_zero",
    [
        ({}, None, False),
        ({"LOCAL_RANK": "0"}, ("LOCAL_RANK", 0), False),
        ({"LOCAL_RANK": "1"}, ("LOCAL_RANK", 1), True),
        ({"LOCAL_RANK": " 3 "}, ("LOCAL_RANK", 3), True),
        ({"SLURM_LOCALID": "2"}, ("SLURM_LOCALID", 2), True),
        # torchrun inside one srun task per node: torchrun's LOCAL_RANK is the process's own
        ({"LOCAL_RANK": "0", "SLURM_LOCALID": "1"}, ("LOCAL_RANK", 0), False),
        ({"LOCAL_RANK": "", "SLURM_LOCALID": "1"}, ("SLURM_LOCALID", 1), True),
        ({"LOCAL_RANK": "one"}, None, False),
        ({"LOCAL_RANK": "-1"}, None, False),
        ({"RANK": "1"}, None, False),  # a global rank alone says nothing of the node
    ],
)
def test_the_launch_environment_tells_a_node_local_rank_above_zero(environ, found, above_zero):
    assert node_local_rank(environ) == found
    assert launched_as_local_rank_above_zero(environ) is above_zero


def test_this_process_reads_its_own_environment(monkeypatch):
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launched_as_local_rank_above_zero()
    monkeypatch.delenv("LOCAL_RANK")
    assert not launched_as_local_rank_above_zero()


def assert_same_layout_on_meta(real: torch.nn.Module, meta: torch.nn.Module) -> None:
    assert layout(meta) == layout(real)
    assert all(t.is_meta for t in (*meta.parameters(), *meta.buffers()))
    assert not has_meta_tensors(real)


def test_a_tiny_spec_on_meta_has_the_real_builds_layout_dtype_and_mode_without_values():
    for spec in (TINY, TinyCausalLM(hidden_size=32, num_layers=1, num_heads=2, dtype="bfloat16")):
        (real, tokenizer), (meta, meta_tokenizer) = spec.build(), spec.build_on_meta()
        assert_same_layout_on_meta(real, meta)
        assert meta.training and meta.generation_config.pad_token_id == real.generation_config.pad_token_id
        assert meta_tokenizer.get_vocab() == tokenizer.get_vocab()


def test_lora_wraps_a_meta_model_with_the_same_adapters():
    lora = LoraSpec(rank=4, init_seed=0)
    real = apply_lora(TINY.build()[0], lora, LLM_LORA_TARGETS)
    meta = apply_lora(TINY.build_on_meta()[0], lora, LLM_LORA_TARGETS)
    assert_same_layout_on_meta(real, meta)
    trainable = [n for n, p in meta.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)


@needs_smollm2
def test_smollm2_on_meta_reads_only_the_config_and_keeps_its_tied_embedding():
    smollm2_dir()
    spec = PretrainedCausalLM("smollm2-135m-instruct", dtype="float32", chat=True)
    (real, tokenizer), (meta, meta_tokenizer) = spec.build(), spec.build_on_meta()
    assert_same_layout_on_meta(real, meta)
    assert meta.lm_head.weight is meta.model.embed_tokens.weight  # tied, as from_pretrained's
    assert meta.config.to_dict() == real.config.to_dict()
    assert meta.generation_config.to_dict() == real.generation_config.to_dict()
    assert meta_tokenizer.chat_template == tokenizer.chat_template and meta_tokenizer.padding_side == "left"


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("freq", torch.arange(3.0), persistent=False)


def test_materializing_keeps_shared_parameters_shared_where_to_empty_alone_does_not():
    with torch.device("meta"):
        alone, module = Tied(), Tied()
    alone.to_empty(device="cpu")
    assert alone.head.weight is not alone.embed.weight  # why materialize re-ties them
    materialize(module, "cpu")
    assert module.head.weight is module.embed.weight
    assert not has_meta_tensors(module) and module.freq.device.type == "cpu"
    assert [n for n, _ in module.named_parameters()] == ["embed.weight"]


def test_a_layout_difference_names_the_tensor_and_both_ranks():
    reference = layout(TINY.build_on_meta()[0])
    other = layout(
        TinyCausalLM(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=96).build_on_meta()[0]
    )
    assert layout_difference(reference, reference, 1) is None
    assert layout_difference(reference, other, 3) == (
        "model.layers.0.mlp.gate_proj.weight is (64, 32) float32 on rank 0 and (96, 32) float32 on rank 3"
    )
    assert (
        layout_difference(reference, reference[:-1], 1)
        == f"{reference[-1][0]} is on rank 0 and not on rank 1"
    )


@pytest.fixture
def local_rank_1(monkeypatch):
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")


def test_a_local_rank_above_zero_builds_the_policy_its_reference_and_a_critic_on_meta(local_rank_1):
    module = tiny_module(PPOModule, policy=TINY, kl_coef=0.1, gradient_checkpointing=True)
    assert module.built_on_meta and module.load_once_per_node
    module.setup("fit")  # the reference copy of a meta policy is on meta too
    assert has_meta_tensors(module.policy) and has_meta_tensors(module.ref_policy)
    assert has_meta_tensors(module.critic.backbone)
    reference = tiny_module(PPOModule, policy=TINY, kl_coef=0.1, load_once_per_node=False)
    assert not reference.built_on_meta and not has_meta_tensors(reference)
    reference.setup("fit")
    assert layout(module) == layout(reference)
    assert "load_once_per_node" not in module.hparams  # a launch setting, not the run's


def test_bf16_masters_of_a_meta_policy_are_float32_on_meta(local_rank_1):
    module = tiny_module(policy=TinyCausalLM(hidden_size=32, num_layers=1, num_heads=2, dtype="bfloat16"))
    module.setup("fit")
    assert {(p.device.type, p.dtype) for p in module.policy.parameters()} == {("meta", torch.float32)}


def test_a_meta_built_module_in_a_single_process_refuses_naming_the_setting(local_rank_1):
    module = tiny_module(policy=TINY)
    module.setup("fit")
    with pytest.raises(ValueError, match="LOCAL_RANK=1 makes this process a node-local rank > 0") as err:
        module.configure_model()
    assert "set load_once_per_node=False" in str(err.value)
    assert "there is no rank 0 to receive the weights from" in str(err.value)


def test_one_process_with_weights_fills_nothing():
    module = tiny_module(policy=TINY)
    assert not module.built_on_meta
    before = {k: v.clone() for k, v in module.state_dict().items()}
    assert ranks_to_fill(module, "load_once_per_node") is False
    module.configure_model()
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
