"""VLLMEngineConfig rejects bad input with errors that say what to change."""

from __future__ import annotations

import subprocess
import sys

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm runs these in .venv-vllm)")

from tests.vllm.conftest import tiny_policy  # noqa: E402
from unirl_lightning.engines.vllm import VLLMEngineConfig  # noqa: E402
from unirl_lightning.lora import LoraSpec  # noqa: E402
from unirl_lightning.models import TinyCausalLM  # noqa: E402


def test_module_imports_without_vllm():
    code = "import sys; sys.modules['vllm'] = None; import unirl_lightning.engines.vllm as m; print(m.VLLMEngineConfig())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_build_without_vllm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees where it is not installed
    with pytest.raises(ImportError, match=r"pip install 'unirl-lightning\[vllm\]'"):
        VLLMEngineConfig(policy=tiny_policy()).build()


def test_lora_rank_vllm_does_not_allow_is_rejected_at_config_time():
    with pytest.raises(ValueError, match=r"LoRA rank 1024 is not allowed by vLLM.*\[1, 512\]"):
        VLLMEngineConfig(lora=LoraSpec(rank=1024, alpha=16.0))


def test_bad_weight_update_and_sleep_level_are_rejected():
    with pytest.raises(ValueError, match="weight_update must be one of"):
        VLLMEngineConfig(weight_update="nccl")
    with pytest.raises(ValueError, match="sleep_level must be 1 or 2"):
        VLLMEngineConfig(sleep_level=3)


def test_missing_policy_is_rejected():
    with pytest.raises(ValueError, match="policy is None"):
        VLLMEngineConfig().build()


def test_cpu_head_size_vllm_cannot_run_is_rejected_before_start():
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the head-size check is for vLLM's CPU attention")
    with pytest.raises(ValueError, match="head sizes .* head size 16"):
        VLLMEngineConfig(policy=TinyCausalLM(hidden_size=64, num_heads=4)).build()


def test_buckets_never_split_a_layer_and_keep_every_tensor_once():
    from unirl_lightning.engines.vllm import layer_buckets

    model, _ = tiny_policy().build()
    tensors = list(model.state_dict().items())
    layer_bytes = sum(t.numel() * t.element_size() for n, t in tensors if n.startswith("model.layers.0."))
    buckets = list(layer_buckets(tensors, bucket_bytes=layer_bytes))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in tensors]
    for bucket in buckets:
        layers = {n.split(".")[2] for n, _ in bucket if n.startswith("model.layers.")}
        assert len(layers) <= 1, f"a bucket mixes layers {layers} beyond the size limit"
    assert len(list(layer_buckets(tensors, bucket_bytes=1 << 40))) == 1


def test_packed_bucket_round_trips_every_dtype():
    import torch

    from unirl_lightning.engines.vllm import pack_bucket, unpack_bucket

    bucket = [
        ("a", torch.randn(3, 4)),
        ("b", torch.randn(5).to(torch.bfloat16)),
        ("c", torch.randn(2, 2).half()),
        ("d", torch.tensor(1.5)),
    ]
    restored = unpack_bucket(pack_bucket(bucket))
    assert [n for n, _ in restored] == ["a", "b", "c", "d"]
    for (_, original), (_, copy) in zip(bucket, restored):
        assert copy.dtype == original.dtype and torch.equal(copy, original)
