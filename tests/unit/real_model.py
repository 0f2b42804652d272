"""Shared by the unit tests that need SmolLM2-135M-Instruct (extra ``real-model``): why they skip,
and the converted copy they load (the default GGUF cache, so only the first run pays ~45 s)."""

from __future__ import annotations

import functools
import importlib.util

import pytest

from unirl_lightning.models.causal_lm import PretrainedCausalLM
from unirl_lightning.models.gguf import REAL_MODEL_EXTRA, smollm2_gguf_path


def _missing_reason() -> str | None:
    try:
        smollm2_gguf_path()
    except FileNotFoundError as err:
        return f"SmolLM2 GGUF not available: {err}"
    if importlib.util.find_spec("gguf") is None:
        return f"the 'gguf' package is not installed ({REAL_MODEL_EXTRA})"
    return None


SMOLLM2_MISSING = _missing_reason()
needs_smollm2 = pytest.mark.skipif(SMOLLM2_MISSING is not None, reason=SMOLLM2_MISSING or "")


@functools.cache
def smollm2_dir() -> str:
    """The float copy of the bundled GGUF in the default cache (converted on first use)."""
    return PretrainedCausalLM("smollm2-135m-instruct", dtype="float32").pretrained_path()


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir())
