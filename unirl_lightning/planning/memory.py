"""The memory model of ``unirl-lightning plan``: a decoder-only transformer's shapes from its
``config.json`` (:class:`ModelShape`) and the peak of one training step (:func:`step_memory_terms`,
:func:`step_peak`, :func:`step_estimate`), as pure functions; docs/gpus.md ("Planning a recipe") has the
formula and its calibration."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

__all__ = ["ModelShape", "step_estimate", "step_memory_terms", "step_peak"]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The shapes of a decoder-only transformer, read from its ``config.json``."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    positions: int
    tied: bool
    has_chat_template: bool | None = None
    model_type: str = ""

    @classmethod
    def from_dir(cls, folder: str | Path) -> ModelShape:
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        tokenizer = folder / "tokenizer_config.json"
        template = None
        if tokenizer.is_file():
            template = bool(json.loads(tokenizer.read_text()).get("chat_template"))
        return cls.from_config(config, has_chat_template=template)

    @classmethod
    def from_config(cls, config: dict[str, Any], has_chat_template: bool | None = None) -> ModelShape:
        """The shapes in a ``config.json``'s contents (``transformers``' ``config.to_dict()``)."""
        return cls(
            hidden=int(config["hidden_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=int(config["num_attention_heads"]),
            kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            positions=int(config.get("max_position_embeddings") or 0),
            tied=bool(config.get("tie_word_embeddings", False)),
            has_chat_template=has_chat_template,
            model_type=str(config.get("model_type") or ""),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def block_params(self) -> int:
        attention = self.hidden * self.hidden * 2 + 2 * self.hidden * self.kv_heads * self.head_dim
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.block_params + embeddings + self.hidden

    def lora_params(self, rank: int) -> int:
        """Adapters on the attention and MLP projections of every block (the LLM targets)."""
        kv = self.kv_heads * self.head_dim
        shapes = [(self.hidden, self.hidden)] * 2 + [(self.hidden, kv)] * 2
        shapes += [(self.hidden, self.intermediate)] * 2 + [(self.intermediate, self.hidden)]
        return self.layers * sum(rank * (a + b) for a, b in shapes)

    def activation_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes one block keeps for its backward per token: the inputs of its norms, projections,
        attention and SwiGLU MLP, ``2(12h + 5i)`` in a 2-byte compute dtype (bf16 autocast) and
        ``3(12h + 5i)`` in float32, not twice as much (under autocast the norms, the softmax and the
        residual stream stay float32 already). Calibrated on CPU (docs/gpus.md)."""
        return (3 if dtype_bytes == 4 else 2) * (12 * self.hidden + 5 * self.intermediate)


def step_memory_terms(
    shape: ModelShape,
    tokens: int,
    kept_tokens: int,
    dtype_bytes: int,
    checkpointing: bool,
    trainable_head: bool = True,
    autocast_params: int = 0,
) -> dict[str, int]:
    """The bytes one micro-batch's forward and backward hold beyond the weights, the optimizer's states
    and the gradients (an estimate, calibrated on CPU: docs/gpus.md):

    * ``activations`` of ``tokens`` tokens computed in a ``dtype_bytes`` dtype, every block's
      (:meth:`ModelShape.activation_bytes_per_token`), or with ``checkpointing`` each block's input (the
      float32 residual stream, ``4h`` a token) plus one block's, recomputed in the backward;
    * ``logits`` of the ``kept_tokens`` positions that get them, and their gradient;
    * ``head_gradient``: the LM head's incoming gradient (the embedding's too when tied), allocated
      before it is added to the parameter's (``trainable_head``: not with LoRA);
    * ``autocast_weights``: the low-precision copies of ``autocast_params`` float32 masters that
      autocast makes and every matmul keeps for its backward (bf16/fp16 compute, unsharded: under FSDP2
      the gathered blocks are the compute copies, freed block by block).
    """
    per_block = tokens * shape.activation_bytes_per_token(dtype_bytes)
    if checkpointing:
        activations = tokens * shape.layers * 4 * shape.hidden + per_block
    else:
        activations = shape.layers * per_block
    head = 4 * shape.vocab * shape.hidden * (2 if shape.tied else 1) if trainable_head else 0
    return {
        "activations": activations,
        "logits": kept_tokens * shape.vocab * 2 * dtype_bytes,
        "head_gradient": head,
        "autocast_weights": 2 * autocast_params,
    }


def step_peak(terms: dict[str, int], gradients: float, one_block: int, micro_batches: int) -> float:
    """The peak of a mini-batch's step from :func:`step_memory_terms` and the ``gradients`` (bytes of the
    trainable parameters' float32 gradients): with several micro-batches the gradients exist while
    every later one runs, so everything adds up; with one, the activations and logits peak at the
    start of the backward, before the gradients fill in (which they do as the activations are freed,
    up to ``gradients`` plus ``one_block``'s activations), so the peak is the larger of the two."""
    always = terms["head_gradient"] + terms["autocast_weights"]
    forward = terms["activations"] + terms["logits"]
    if micro_batches > 1:
        return gradients + forward + always
    return max(forward, gradients + one_block) + always


def step_estimate(
    shape: ModelShape,
    tokens: int,
    kept_tokens: int,
    dtype_bytes: int,
    checkpointing: bool,
    gradients: float,
    micro_batches: int,
    trainable_head: bool = True,
    autocast_params: int = 0,
) -> tuple[dict[str, float], float]:
    """The terms of a mini-batch's step (``gradients_fp32``: the float32 gradients this rank holds,
    then :func:`step_memory_terms`'s) and its :func:`step_peak`, in bytes: what ``plan`` adds to the
    weights and optimizer states of a training rank, and what ``benchmarks/performance/memory_step.py`` checks."""
    terms = step_memory_terms(
        shape, tokens, kept_tokens, dtype_bytes, checkpointing, trainable_head, autocast_params
    )
    one_block = tokens * shape.activation_bytes_per_token(dtype_bytes)
    return {"gradients_fp32": gradients, **terms}, step_peak(terms, gradients, one_block, micro_batches)
