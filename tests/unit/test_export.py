"""Export: a checkpoint's policy, written in the Hugging Face layout, loads back with transformers, peft
and diffusers with the trained parameters and the same greedy outputs; from a single file and from a
folder of FSDP2 shards (2 gloo ranks); and the mistakes fail naming what is wrong."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from unirl_lightning.models.causal_lm import PretrainedCausalLM, TinyCausalLM
from unirl_lightning.models.export import (
    SHARDED_METADATA,
    export_checkpoint,
    export_policy,
    load_policy_checkpoint,
)
from unirl_lightning.models.lora import LoraSpec, effective_weights

PROMPTS = ["1+2=", "3*4=", "7=", "12-5="]
TINY = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


def module(lora: LoraSpec | None = None, policy=None):
    from unirl_lightning.modules import GRPOModule

    return GRPOModule(policy=policy or TinyCausalLM(**TINY), lora=lora, num_generations=2, max_new_tokens=4)


def train_a_little(model: torch.nn.Module, seed: int = 1) -> None:
    """Move every trainable weight off its initial value (what a few optimizer steps do)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))


def save_checkpoint(trained, path: Path) -> Path:
    """A Lightning checkpoint of ``trained`` as ``Trainer.save_checkpoint`` lays it out."""
    torch.save(
        {"state_dict": trained.state_dict(), "global_step": 2, "optimizer_states": [], "epoch": 0}, path
    )
    return path


def greedy(model, tokenizer, prompts=PROMPTS, max_new_tokens: int = 6) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            tokens = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        out.append(tokens[0, ids.shape[1] :].tolist())
    return out


def assert_same_weights(expected: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    got = model.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_full_policy_exports_a_transformers_model_with_its_tokenizer_and_generation_config(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    trained = module()
    train_a_little(trained.policy)
    ckpt = save_checkpoint(trained, tmp_path / "last.ckpt")
    fresh = module()  # what the CLI builds from the config
    export_checkpoint(fresh, ckpt, tmp_path / "hf")

    files = set(os.listdir(tmp_path / "hf"))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert_same_weights(trained.policy.state_dict(), loaded)
    assert greedy(loaded, tokenizer) == greedy(trained.policy, trained.tokenizer)
    assert tokenizer("12-5=")["input_ids"] == trained.tokenizer("12-5=")["input_ids"]
    assert GenerationConfig.from_pretrained(tmp_path / "hf").pad_token_id == trained.tokenizer.pad_token_id
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".hf.partial")], "the staging folder stays"


def test_lora_policy_exports_its_adapter_and_merged_the_full_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora = LoraSpec(rank=4, alpha=8)
    trained = module(lora=lora)
    train_a_little(trained.policy)  # the adapters only: the base is frozen
    ckpt = save_checkpoint(trained, tmp_path / "last.ckpt")
    expected = greedy(trained.policy, trained.tokenizer)

    export_checkpoint(module(lora=lora), ckpt, tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "adapter"))
    assert "model.safetensors" not in os.listdir(tmp_path / "adapter")
    base, tokenizer = TinyCausalLM(**TINY).build()
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert effective_weights(adapted).keys() == effective_weights(trained.policy).keys()
    for name, tensor in effective_weights(trained.policy).items():
        torch.testing.assert_close(effective_weights(adapted)[name], tensor, rtol=0, atol=0)
    assert greedy(adapted, tokenizer) == expected

    export_checkpoint(module(lora=lora), ckpt, tmp_path / "merged", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert_same_weights(effective_weights(trained.policy), merged)
    assert greedy(merged, tokenizer) == expected
    assert not any(".lora_" in name for name in merged.state_dict())


def test_a_pretrained_chat_policy_keeps_its_chat_template(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = TinyCausalLM(**TINY).build()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    policy = PretrainedCausalLM(str(tmp_path / "base"), dtype="float32", chat=True)
    trained = module(policy=policy)
    train_a_little(trained.policy)
    export_policy(trained, tmp_path / "hf")

    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert exported.chat_template == tokenizer.chat_template
    messages = [{"role": "user", "content": "3*4"}]
    assert exported.apply_chat_template(messages, tokenize=False) == "3*4="
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert greedy(loaded, exported) == greedy(trained.policy, trained.tokenizer)


def test_flow_grpo_exports_the_denoiser_in_the_diffusers_layout(tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from peft import PeftModel

    from unirl_lightning.models.diffusion import TinyFlowModel
    from unirl_lightning.modules import FlowGRPOModule

    spec = TinyFlowModel(pretrain_steps=0)
    latents, sigma = torch.randn(2, 3, 8, 8), torch.tensor([0.7, 0.3])

    def velocity(flow, denoiser):
        return flow.pipeline.velocity(denoiser, latents, sigma, flow.pipeline.encode_null(2, "cpu"))

    full = FlowGRPOModule(policy=spec, num_generations=2, num_steps=2)
    train_a_little(full.policy)
    export_policy(full, tmp_path / "full")
    assert {"transformer", "scheduler"} <= set(os.listdir(tmp_path / "full"))
    transformer = SD3Transformer2DModel.from_pretrained(tmp_path / "full", subfolder="transformer")
    FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path / "full", subfolder="scheduler")
    assert_same_weights(full.policy.state_dict(), transformer)
    torch.testing.assert_close(velocity(full, transformer), velocity(full, full.policy))

    lora = FlowGRPOModule(policy=spec, lora=LoraSpec(rank=2), num_generations=2, num_steps=2)
    train_a_little(lora.policy)
    export_policy(lora, tmp_path / "adapter")
    assert "adapter_config.json" in os.listdir(tmp_path / "adapter" / "transformer")
    base = spec.build().denoiser
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter" / "transformer")
    torch.testing.assert_close(velocity(lora, adapted), velocity(lora, lora.policy))
    native = spec.build().denoiser  # diffusers' own LoRA loading (what pipe.load_lora_weights does)
    native.load_lora_adapter(tmp_path / "adapter", prefix="transformer", use_safetensors=True)
    torch.testing.assert_close(velocity(lora, native), velocity(lora, lora.policy))
    export_policy(lora, tmp_path / "merged", merge=True)
    merged = SD3Transformer2DModel.from_pretrained(tmp_path / "merged", subfolder="transformer")
    torch.testing.assert_close(velocity(lora, merged), velocity(lora, lora.policy), rtol=1e-5, atol=1e-5)


# -- the mistakes ----------------------------------------------------------------------------------
def test_a_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such.ckpt"):
        export_checkpoint(module(), tmp_path / "no_such.ckpt", tmp_path / "hf")
    (tmp_path / "folder").mkdir()
    with pytest.raises(FileNotFoundError, match=f"not a sharded Lightning checkpoint .*{SHARDED_METADATA}"):
        export_checkpoint(module(), tmp_path / "folder", tmp_path / "hf")


def test_a_non_empty_output_is_refused_unless_overwrite_which_replaces_it(tmp_path):
    trained = module()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "old.txt").write_text("x")
    with pytest.raises(FileExistsError, match="exists and is not empty.*overwrite"):
        export_policy(trained, tmp_path / "hf")
    export_policy(trained, tmp_path / "hf", overwrite=True)
    assert "old.txt" not in os.listdir(tmp_path / "hf") and "model.safetensors" in os.listdir(tmp_path / "hf")
    (tmp_path / "empty").mkdir()
    export_policy(trained, tmp_path / "empty")  # an empty directory is fine


def test_merge_without_lora_says_the_policy_is_already_full(tmp_path):
    with pytest.raises(ValueError, match="no LoRA adapters.*already the full model"):
        export_policy(module(), tmp_path / "hf", merge=True)
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_of_another_policy_is_refused_naming_the_tensors(tmp_path):
    ckpt = save_checkpoint(module(lora=LoraSpec(rank=4)), tmp_path / "lora.ckpt")
    with pytest.raises(KeyError, match="does not hold this config's policy: missing"):
        load_policy_checkpoint(module(), ckpt)


# -- a folder of FSDP2 shards --------------------------------------------------------------------
class _Strategy:
    def barrier(self, name=None):
        torch.distributed.barrier()


class _Trainer:
    strategy = _Strategy()

    def __init__(self, rank: int) -> None:
        self.is_global_zero = rank == 0


def _sharded_rank(rank: int, folder: str, lora_rank: int) -> None:
    """One of 2 gloo ranks: FSDP2-shard a trained module as AsyncRolloutFSDPStrategy does, write the
    sharded checkpoint as Lightning's ModelParallelStrategy does, and export at train end with the
    callback (the gather of every tensor is a collective of both ranks)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from unirl_lightning.callbacks import ExportOnTrainEnd
    from unirl_lightning.distributed.sharding import is_sharded, shard_children

    torch.set_num_threads(1)
    # a file store, not a TCP one: no port to race for, and no store server living in rank 0 that
    # rank 1 still needs while the two tear down
    store = dist.FileStore(str(Path(folder).parent / "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        trained = module(lora=LoraSpec(rank=lora_rank) if lora_rank else None)
        train_a_little(trained.policy)
        whole = {name: t.clone() for name, t in trained.policy.state_dict().items()}
        shard_children(trained, init_device_mesh("cpu", (2,)))
        assert any(is_sharded(t) for t in trained.state_dict().values())
        dcp.save({"state_dict": trained.state_dict()}, checkpoint_id=folder)
        if rank == 0:
            torch.save({"global_step": 2, "epoch": 0}, Path(folder) / SHARDED_METADATA)
            torch.save(whole, Path(folder).parent / "whole.pt")
        ExportOnTrainEnd(str(Path(folder).parent / "callback"), merge=bool(lora_rank)).on_train_end(
            _Trainer(rank), trained
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_sharded_fsdp_checkpoint_folder_exports_in_one_process(tmp_path, lora_rank):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "last.ckpt"
    torch.multiprocessing.start_processes(
        _sharded_rank, args=(str(folder), lora_rank), nprocs=2, start_method="spawn"
    )
    assert (folder / ".metadata").is_file() and (folder / SHARDED_METADATA).is_file()
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    lora = LoraSpec(rank=lora_rank) if lora_rank else None
    reference = module(lora=lora)
    reference.policy.load_state_dict(whole)

    fresh = module(lora=lora)  # what the CLI builds: no process group, one process
    export_checkpoint(fresh, folder, tmp_path / "hf", merge=lora is not None)
    expected = effective_weights(reference.policy)
    for exported in ("hf", "callback"):  # the CLI from the folder, the callback from the live shards
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / exported)
        assert_same_weights(expected, loaded)
        assert greedy(loaded, reference.tokenizer) == greedy(reference.policy, reference.tokenizer)
