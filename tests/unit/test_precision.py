"""Mixed precision: a bf16 policy trains on float32 masters with bf16 compute, and pushes bf16."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.builders import tiny_module
from unirl_lightning.distributed.sharding import mixed_precision_policy
from unirl_lightning.engines.hf import HFEngine, HFEngineConfig
from unirl_lightning.models.causal_lm import TinyCausalLM
from unirl_lightning.models.lora import LoraSpec
from unirl_lightning.modules import PPOModule
from unirl_lightning.modules.optim import upcast_trainable_parameters
from unirl_lightning.rollout.batches import ExperienceBatch
from unirl_lightning.rollout.records import Rollout
from unirl_lightning.weight_sync.base import named_weights, serving_dtype, tensor_bytes
from unirl_lightning.weight_sync.buckets import PackedWeights, cast_floating
from unirl_lightning.weight_sync.collective import _bucket_layout

BF16_POLICY = TinyCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, dtype="bfloat16")


def a_batch() -> ExperienceBatch:
    g = torch.Generator().manual_seed(0)
    rows = [
        Rollout(
            prompt_ids=torch.randint(3, 17, (p,), generator=g).tolist(),
            completion_ids=torch.randint(3, 17, (3,), generator=g).tolist(),
            logprobs=[-1.0] * 3,
            reward=float(i % 2),
            finish_reason="length",
        )
        for i, p in enumerate([4, 3, 5, 4])
    ]
    return ExperienceBatch.collate([rows], pad_token_id=0)


def one_step(module, optimizer) -> None:
    """One optimizer step on a loss of the trainer's log-probs (every weight gets a gradient)."""
    batch = a_batch()
    optimizer.zero_grad()
    logp = module.sequence_logprobs(module.policy, batch)
    assert logp.dtype == torch.float32
    (-(logp * batch.response_mask[:, 1:]).sum()).backward()
    optimizer.step()


def test_a_bf16_policy_trains_float32_masters_that_move_at_lr_1e_6():
    module = tiny_module(policy=BF16_POLICY, lr=1e-6, kl_coef=0.1)
    assert module.compute_dtype == torch.bfloat16
    assert {p.dtype for p in module.policy.parameters()} == {torch.bfloat16}, "built as the spec says"
    module.setup("fit")
    assert {p.dtype for p in module.policy.parameters()} == {torch.float32}, "trainable: float32 masters"
    assert {p.dtype for p in module.ref_policy.parameters()} == {torch.bfloat16}, (
        "the frozen reference stays bf16"
    )
    assert serving_dtype(module.policy) == torch.bfloat16
    optimizer = module.configure_optimizers()
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}

    with module.autocast("cpu"):  # the forward computes in bf16 from the float32 masters
        logits = module.policy(input_ids=a_batch().input_ids).logits
    assert logits.dtype == torch.bfloat16
    one_step(module, optimizer)

    state = [s for s in optimizer.state.values() if s]
    assert state and {s["exp_avg"].dtype for s in state} == {s["exp_avg_sq"].dtype for s in state} == {
        torch.float32
    }
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in module.policy.named_parameters()}
    # AdamW's first step moves every weight with a gradient by ~lr: far below bf16's resolution
    # (2**-8 relative, ~1e-4 at these magnitudes), kept by the float32 masters
    assert all(0 < d < 2e-6 for d in moved.values()), moved
    masters = torch.cat([(p.detach() != before[n]).flatten() for n, p in module.policy.named_parameters()])
    rounded = torch.cat(
        [
            (p.detach().bfloat16() != before[n].bfloat16()).flatten()
            for n, p in module.policy.named_parameters()
        ]
    )
    # nearly every master moved; rounded to bf16 nearly none did (only weights within ~1e-4 of 0):
    # pure bf16 weights would have lost the step (next test)
    assert masters.float().mean() > 0.95 and rounded.float().mean() < 0.05


def test_pure_bf16_weights_lose_an_update_at_lr_1e_6():
    """What the masters fix: AdamW over the bf16 parameters themselves (no setup upcast) rounds the
    ~1e-6 updates away: one step leaves all but the weights nearest 0 bit-identical (the previous
    test, with masters, moves nearly all of them)."""
    module = tiny_module(policy=BF16_POLICY, lr=1e-6)
    optimizer = module.configure_optimizers()  # no setup: the bf16 parameters are the optimizer's
    before = copy.deepcopy(module.policy.state_dict())
    one_step(module, optimizer)
    changed = torch.cat([(module.policy.state_dict()[n] != before[n]).flatten() for n in before])
    assert changed.float().mean() < 0.05


def test_the_push_sends_bf16_bit_equal_to_the_rounded_masters_and_the_engine_serves_them():
    module = tiny_module(policy=BF16_POLICY, lr=1e-6)
    module.setup("fit")
    one_step(module, module.configure_optimizers())
    dtype = serving_dtype(module.policy)
    rounded = {n: p.detach().to(torch.bfloat16) for n, p in module.policy.named_parameters()}

    tensors = named_weights(module.policy, dtype)
    packed = PackedWeights.pack(tensors.items(), dtype)  # the object-store push
    assert set(packed.dtypes) == {"bfloat16"}
    pushed = dict(packed.tensors())
    assert pushed.keys() == rounded.keys()
    assert all(pushed[n].equal(rounded[n]) for n in rounded), "bit-equal to the masters rounded to bf16"
    assert tensor_bytes(tensors, dtype) == sum(t.numel() * 2 for t in rounded.values())
    # the collective push: every bucket travels as bf16
    layout, dtypes = _bucket_layout(tensors, bucket_bytes=4096, dtype=dtype)
    assert set(dtypes) == {torch.bfloat16} and sum(len(b) for b in layout) == len(rounded)

    engine = HFEngine(HFEngineConfig(device="cpu", num_threads=None), BF16_POLICY, None)
    engine.load_weights(packed.tensors(), weight_version=1)
    served = engine.state_dict()
    assert all(served[n].dtype == torch.bfloat16 and served[n].equal(rounded[n]) for n in rounded)


def test_with_lora_only_the_adapters_become_float32_and_they_are_pushed_as_held():
    module = tiny_module(policy=BF16_POLICY, lora=LoraSpec(rank=4, alpha=8))
    module.setup("fit")
    trainable = {p.dtype for p in module.policy.parameters() if p.requires_grad}
    frozen = {p.dtype for p in module.policy.parameters() if not p.requires_grad}
    assert trainable == {torch.float32} and frozen == {torch.bfloat16}
    assert serving_dtype(module.policy) is None, "adapters go as the engines hold theirs (float32)"


def test_a_float32_policy_is_left_alone():
    module = tiny_module()
    assert module.compute_dtype is None
    module.setup("fit")
    assert {p.dtype for p in module.policy.parameters()} == {torch.float32}
    assert serving_dtype(module.policy) is None
    with module.autocast("cpu"):
        assert not torch.is_autocast_enabled("cpu")


def test_the_ppo_critic_trains_uniform_float32_parameters_as_fsdp2_needs():
    module = tiny_module(PPOModule, policy=BF16_POLICY, num_generations=2)
    module.setup("fit")
    # FSDP2 wants one dtype over the trainable parameters of each shard group: the value head was
    # float32 next to a bf16 backbone before the masters
    for network in (module.policy, module.critic):
        assert {p.dtype for p in network.parameters() if p.requires_grad} == {torch.float32}


def test_upcasting_is_idempotent_and_keeps_the_parameter_objects():
    model, _ = BF16_POLICY.build()
    params = list(model.parameters())
    assert upcast_trainable_parameters(model) == len(params)
    assert upcast_trainable_parameters(model) == 0
    assert all(a is b for a, b in zip(params, model.parameters()))


def test_fsdp2_gathers_in_the_compute_dtype_and_reduces_in_float32():
    policy = mixed_precision_policy(torch.bfloat16)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision_policy(None).param_dtype is None


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_cast_floating_casts_floating_tensors_only(dtype):
    ints, floats = torch.arange(3), torch.randn(3)
    assert cast_floating(ints, dtype) is ints
    assert cast_floating(floats, dtype).dtype == (dtype or torch.float32)


def test_the_optimizer_is_torchs_fused_adamw_and_steps_as_the_default_one_does():
    """The fused kernel is picked for float32 CPU masters (and for bf16 compute over them, and for
    PPO's critic group); three steps land on the same weights as torch's default AdamW."""
    fused = tiny_module(lr=1e-3, weight_decay=0.01)
    default = copy.deepcopy(fused)
    optimizer = fused.configure_optimizers()
    assert [g["fused"] for g in optimizer.param_groups] == [True]
    reference = torch.optim.AdamW(
        [p for p in default.policy.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01
    )
    assert not reference.param_groups[0]["fused"]
    for _ in range(3):
        one_step(fused, optimizer)
        one_step(default, reference)
    diffs = [
        (a - b).abs().max().item() for a, b in zip(fused.policy.parameters(), default.policy.parameters())
    ]
    assert max(diffs) <= 1e-7, diffs

    masters = tiny_module(policy=BF16_POLICY)
    masters.setup("fit")
    assert masters.configure_optimizers().param_groups[0]["fused"]
    ppo = tiny_module(PPOModule)
    assert [g["fused"] for g in ppo.configure_optimizers().param_groups] == [True, True]


def test_parameters_the_fused_kernel_cannot_take_get_torchs_default_adamw():
    from unirl_lightning.modules.optim import adamw

    meta = [torch.nn.Parameter(torch.zeros(2, device="meta"))]
    assert not adamw(meta, lr=0.1).param_groups[0]["fused"]
    assert adamw([torch.nn.Parameter(torch.zeros(2))], lr=0.1).param_groups[0]["fused"]


def test_under_lightnings_amp_plugin_the_optimizer_is_not_fused():
    """``Trainer(precision="bf16-mixed")`` refuses to clip the gradients of an optimizer that
    unscales them itself (the fused kernel), so the default AdamW is kept there."""
    from lightning.pytorch import Trainer

    module = tiny_module()
    module.trainer = Trainer(
        precision="bf16-mixed", accelerator="cpu", logger=False, enable_checkpointing=False
    )
    assert not module.configure_optimizers().param_groups[0]["fused"]
    module.trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    assert module.configure_optimizers().param_groups[0]["fused"]
