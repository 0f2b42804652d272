"""An exported policy is servable by vLLM as it is: ``vllm.LLM(model=exported_dir)`` (the CPU build) loads
the directory ``unirl-lightning export`` writes, full and LoRA-merged, and generates greedily what the
trained model generates with transformers."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm runs these in .venv-vllm)")

import torch  # noqa: E402

from tests.vllm.helpers import PROMPTS, tiny_policy  # noqa: E402
from unirl_lightning.models.export import export_policy  # noqa: E402
from unirl_lightning.models.lora import LoraSpec  # noqa: E402

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 8


def trained_module(lora: LoraSpec | None = None):
    """The tiny Llama vLLM's CPU attention takes, with every trainable weight moved off its init."""
    from unirl_lightning.modules import GRPOModule

    module = GRPOModule(policy=tiny_policy(), lora=lora, num_generations=2, max_new_tokens=4)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in module.policy.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return module


def hf_greedy(module) -> list[list[int]]:
    tokenizer, out = module.tokenizer, []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            tokens = module.policy.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,  # the same length on both sides
                pad_token_id=tokenizer.pad_token_id,
            )
        out.append(tokens[0, ids.shape[1] :].tolist())
    return out


@pytest.mark.parametrize("lora", [None, LoraSpec(rank=4)], ids=["full", "lora-merged"])
def test_vllm_serves_the_exported_directory_and_generates_what_the_trainer_would(tmp_path, lora):
    module = trained_module(lora)
    exported = export_policy(module, tmp_path / "hf", merge=lora is not None)
    llm = vllm.LLM(
        model=str(exported),
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=64,
        kv_cache_memory_bytes=64 * 1024**2,
    )
    try:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params)
    finally:  # free the engine, as VLLMEngine.close does (the next test builds another in this process)
        shutdown = getattr(llm.llm_engine.engine_core, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del llm
    completions = [list(o.outputs[0].token_ids) for o in outputs]
    assert all(len(c) == MAX_NEW_TOKENS for c in completions)
    assert completions == hf_greedy(module)
