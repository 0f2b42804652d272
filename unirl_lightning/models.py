"""Policy specs: picklable recipes that build ``(model, tokenizer)`` in any process.

The trainer and every rollout worker build the same architecture from the same spec; weights then
flow trainer -> workers through ``weight_sync``. Two specs:

* :class:`PretrainedCausalLM` loads a hub id or a local path with ``from_pretrained`` (GPU recipes).
* :class:`TinyCausalLM` builds a small Llama-style model with random init and a character-level
  tokenizer, locally, with no download (tests and the CPU demo).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHAR_VOCAB = ("<pad>", "<bos>", "<eos>", *"0123456789", "+", "-", "*", "=", " ", "?", ".", ",")


def build_char_tokenizer(chars: tuple[str, ...] = CHAR_VOCAB):
    """A character-level ``PreTrainedTokenizerFast``: one token per character, decode without spaces."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?" if "?" in vocab else None))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", padding_side="left"
    )


@dataclass
class TinyCausalLM:
    """A tiny random-init Llama with a character tokenizer, built locally.

    Example::

        model, tokenizer = TinyCausalLM(hidden_size=64, num_layers=2).build()
    """

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 128
    max_position_embeddings: int = 64
    seed: int = 0

    def build(self) -> tuple[Any, Any]:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        tokenizer = build_char_tokenizer()
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads,
            max_position_embeddings=self.max_position_embeddings,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            tie_word_embeddings=False,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = LlamaForCausalLM(config)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        return model.float(), tokenizer


@dataclass
class PretrainedCausalLM:
    """A causal LM from a hub id or local path (``from_pretrained``).

    Example::

        model, tokenizer = PretrainedCausalLM("Qwen/Qwen2.5-0.5B-Instruct", dtype="bfloat16").build()
    """

    name_or_path: str
    dtype: str = "bfloat16"
    trust_remote_code: bool = False
    attn_implementation: str | None = None

    def build(self) -> tuple[Any, Any]:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        allowed = ("float32", "bfloat16", "float16")
        if self.dtype not in allowed:
            raise ValueError(f"dtype must be one of {allowed}, got {self.dtype!r}")
        tokenizer = AutoTokenizer.from_pretrained(self.name_or_path, trust_remote_code=self.trust_remote_code)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        kwargs: dict[str, Any] = {
            "dtype": getattr(torch, self.dtype),
            "trust_remote_code": self.trust_remote_code,
        }
        if self.attn_implementation:
            kwargs["attn_implementation"] = self.attn_implementation
        model = AutoModelForCausalLM.from_pretrained(self.name_or_path, **kwargs)
        return model, tokenizer


PolicySpec = TinyCausalLM | PretrainedCausalLM
