"""The GPU smoke checks of training (``gpu_smoke.py``): the bf16 policy's GRPO module, a random
collated batch, and the checks ``mixed_precision`` (float32 masters and fused AdamW state under bf16
compute) and ``fsdp2_fit`` (one ``Trainer.fit`` under ``ModelParallelStrategy``). A helper module (no
``main``); the library is imported inside the functions."""

from __future__ import annotations

from typing import Any


def spec(sizes: dict[str, int]):
    from unirl_lightning.models.causal_lm import TinyCausalLM

    return TinyCausalLM(
        hidden_size=sizes["hidden"],
        num_layers=sizes["layers"],
        num_heads=4,
        intermediate_size=2 * sizes["hidden"],
        max_position_embeddings=512,
        vocab_size=sizes["vocab"],
        dtype="bfloat16",
    )


def smoke_module(sizes: dict[str, int], **overrides: Any):
    """A GRPO module on the bf16 policy, without the callbacks that need the rollout strategy."""
    from unirl_lightning.modules import GRPOModule
    from unirl_lightning.rewards import ExactMatchReward

    class SmokeGRPO(GRPOModule):
        def configure_callbacks(self):  # the defaults drive the rollout strategy's weight sync
            return []

    kwargs = dict(
        policy=spec(sizes),
        reward=ExactMatchReward(),
        num_generations=4,
        max_new_tokens=sizes["new_tokens"],
        temperature=1.0,
        lr=1e-6,
    )
    kwargs.update(overrides)
    return SmokeGRPO(**kwargs)


def random_batch(sizes: dict[str, int], pad_token_id: int, seed: int = 0):
    import torch

    from unirl_lightning.rollout.batches import ExperienceBatch
    from unirl_lightning.rollout.records import Rollout

    g = torch.Generator().manual_seed(seed)
    rows = [
        Rollout(
            prompt_ids=torch.randint(3, 20, (int(p),), generator=g).tolist(),
            completion_ids=torch.randint(3, sizes["vocab"], (sizes["new_tokens"],), generator=g).tolist(),
            logprobs=[-1.0] * sizes["new_tokens"],
            reward=float(i % 2),
            finish_reason="length",
        )
        for i, p in enumerate(torch.randint(4, 12, (8,), generator=g))
    ]
    groups = [rows[i : i + 4] for i in range(0, len(rows), 4)]
    return ExperienceBatch.collate(groups, pad_token_id=pad_token_id)


def check_mixed_precision(record: dict, smoke: Any):
    import torch

    module = smoke_module(smoke.sizes, kl_coef=0.05)
    module.setup("fit")
    module.to(smoke.device)
    optimizer = module.configure_optimizers()
    batch = random_batch(smoke.sizes, module.tokenizer.pad_token_id).to(smoke.device)
    with module.autocast(smoke.device.type):
        logits_dtype = module.policy(input_ids=batch.input_ids[:, :4]).logits.dtype
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    optimizer.zero_grad()
    logp = module.sequence_logprobs(module.policy, batch)
    (-(logp * batch.response_mask[:, 1:]).sum()).backward()
    # the elements with a gradient (embedding rows of tokens absent from the batch have none)
    touched = torch.cat([(p.grad != 0).flatten() for p in module.policy.parameters()])
    optimizer.step()
    masters = torch.cat([(p.detach() != before[n]).flatten() for n, p in module.policy.named_parameters()])
    rounded = torch.cat(
        [
            (p.detach().bfloat16() != before[n].bfloat16()).flatten()
            for n, p in module.policy.named_parameters()
        ]
    )
    states = [s for s in optimizer.state.values() if s]
    record.update(
        param_dtypes=sorted({str(p.dtype) for p in module.policy.parameters()}),
        reference_dtypes=sorted({str(p.dtype) for p in module.ref_policy.parameters()}),
        optimizer_state_dtypes=sorted({str(s["exp_avg"].dtype) for s in states}),
        optimizer_fused=bool(optimizer.param_groups[0]["fused"]),  # torch's fused AdamW kernel on the device
        autocast_logits_dtype=str(logits_dtype),
        logprob_dtype=str(logp.dtype),
        fraction_masters_moved=float(masters[touched].float().mean()),
        fraction_bf16_rounded_moved=float(rounded[touched].float().mean()),
    )
    record["ok"] = (
        record["param_dtypes"] == ["torch.float32"]
        and record["reference_dtypes"] == ["torch.bfloat16"]
        and record["optimizer_state_dtypes"] == ["torch.float32"]
        and record["optimizer_fused"]
        and logits_dtype == torch.bfloat16
        and record["fraction_masters_moved"] > 0.9
    )
    return module


def check_fsdp2_fit(record: dict, smoke: Any) -> None:
    import torch
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    from unirl_lightning.distributed.sharding import is_sharded

    module = smoke_module(smoke.sizes, kl_coef=0.05)
    batches = [random_batch(smoke.sizes, module.tokenizer.pad_token_id, seed=s) for s in range(2)]
    backend = "nccl" if smoke.device.type == "cuda" else "gloo"
    trainer = Trainer(
        accelerator=smoke.device.type,
        devices=1,
        strategy=ModelParallelStrategy(process_group_backend=backend),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    params = list(module.policy.parameters())
    optimizer = trainer.optimizers[0]
    states = [s for s in optimizer.state.values() if s]
    param_dtype = None
    if hasattr(module.policy, "_get_fsdp_state"):  # an FSDP2 module: its root group's policy
        group = module.policy._get_fsdp_state()._fsdp_param_group
        param_dtype = str(group.mp_policy.param_dtype) if group is not None else None
    record.update(
        backend=backend,
        global_step=trainer.global_step,
        sharded=all(is_sharded(p) for p in params),
        master_dtypes=sorted({str(p.dtype) for p in params}),
        reference_dtypes=sorted({str(p.dtype) for p in module.ref_policy.parameters()}),
        optimizer_state_dtypes=sorted({str(s["exp_avg"].dtype) for s in states}),
        mixed_precision_param_dtype=param_dtype,
        loss=float(module.last_step_metrics.get("loss", float("nan"))),
    )
    record["ok"] = (
        trainer.global_step == 2
        and record["sharded"]
        and record["master_dtypes"] == ["torch.float32"]
        and record["optimizer_state_dtypes"] == ["torch.float32"]
        and param_dtype == "torch.bfloat16"
        and record["loss"] == record["loss"]
    )
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
