"""The serving engines' configuration and glue, where vLLM and SGLang are absent: they import without
their backend, name the extra to install, reject bad values, and bucket and pack weights correctly."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from unirl_lightning.engines.vllm import VLLMEngineConfig
from unirl_lightning.models.causal_lm import TinyCausalLM
from unirl_lightning.models.lora import LoraSpec
from unirl_lightning.weight_sync.buckets import PackedWeights, pack_tensors, unpack_tensors, weight_buckets


def test_module_imports_without_vllm():
    code = "import sys; sys.modules['vllm'] = None; import unirl_lightning.engines.vllm as m; print(m.VLLMEngineConfig())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_build_without_vllm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` sees where it is not installed
    with pytest.raises(ImportError, match=r"pip install 'unirl-lightning\[vllm\]'"):
        VLLMEngineConfig().build(TinyCausalLM(hidden_size=64, num_heads=2))


def test_lora_rank_vllm_does_not_allow_is_rejected_on_the_driver():
    with pytest.raises(ValueError, match=r"lora.rank must be in \[1, 512\] for vLLM.*got 1024"):
        VLLMEngineConfig().validate(TinyCausalLM(), LoraSpec(rank=1024, alpha=16.0))
    VLLMEngineConfig().validate(TinyCausalLM(), LoraSpec(rank=8))


def test_bad_weight_update_and_sleep_level_are_rejected():
    with pytest.raises(
        ValueError, match=r"weight_update must be one of \('auto', 'reload', 'load_weights'\), got 'nccl'"
    ):
        VLLMEngineConfig(weight_update="nccl")
    with pytest.raises(ValueError, match=r"sleep_level must be one of \(1, 2\), got 3"):
        VLLMEngineConfig(sleep_level=3)


def test_continuous_vllm_needs_its_engine_core_in_a_process_of_its_own_and_a_known_batching():
    assert VLLMEngineConfig(batching="continuous").loads_in_flight
    assert VLLMEngineConfig(batching="continuous", concurrent_calls=5).max_concurrency == 5
    assert not VLLMEngineConfig().loads_in_flight and VLLMEngineConfig().max_concurrency == 1
    with pytest.raises(ValueError, match="engine.batching='continuous' runs vLLM's AsyncLLM"):
        VLLMEngineConfig(batching="continuous", in_process_core=True)
    with pytest.raises(ValueError, match=r"batching must be one of \('static', 'continuous'\), got 'paged'"):
        VLLMEngineConfig(batching="paged")
    with pytest.raises(ValueError, match="concurrent_calls must be > 0, got 0"):
        VLLMEngineConfig(batching="continuous", concurrent_calls=0)


def test_buckets_never_split_a_layer_and_keep_every_tensor_once():
    model, _ = TinyCausalLM(num_layers=3).build()
    tensors = list(model.state_dict().items())
    layer_bytes = sum(t.numel() * t.element_size() for n, t in tensors if n.startswith("model.layers.0."))
    buckets = list(weight_buckets(tensors, bucket_bytes=layer_bytes, whole_layers=True))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in tensors]
    for bucket in buckets:
        layers = {n.split(".")[2] for n, _ in bucket if n.startswith("model.layers.")}
        assert len(layers) <= 1, f"a bucket mixes layers {layers} beyond the size limit"
    assert len(list(weight_buckets(tensors, bucket_bytes=1 << 40, whole_layers=True))) == 1


def test_flat_buckets_hold_one_dtype_and_respect_the_size():
    tensors = [
        ("a", torch.zeros(4)),
        ("b", torch.zeros(4)),
        ("c", torch.zeros(4).double()),
        ("d", torch.zeros(8)),
    ]
    buckets = [[n for n, _ in b] for b in weight_buckets(tensors, bucket_bytes=32)]
    assert buckets == [["a", "b"], ["c"], ["d"]]


def test_packed_bucket_round_trips_every_dtype():
    bucket = [
        ("a", torch.randn(3, 4)),
        ("b", torch.randn(5).to(torch.bfloat16)),
        ("c", torch.randn(2, 2).half()),
        ("d", torch.tensor(1.5)),
    ]
    for as_bytes in (False, True):
        restored = unpack_tensors(pack_tensors(bucket, as_bytes=as_bytes))
        assert [n for n, _ in restored] == ["a", "b", "c", "d"]
        for (_, original), (_, copy) in zip(bucket, restored):
            assert copy.dtype == original.dtype and torch.equal(copy, original)


def test_packed_weights_cross_the_object_store_as_shared_memory_views(ray_local):
    bucket = [
        ("a", torch.randn(3, 4)),
        ("b", torch.randn(5).to(torch.bfloat16)),
        ("c", torch.randn(2, 2).half()),
        ("d", torch.tensor(1.5)),
        ("e", torch.randn(4, 6).t()),  # not contiguous: packed as its values
    ]
    packed = PackedWeights.pack(bucket)
    assert sum(array.nbytes for array in packed.arrays) == sum(
        t.numel() * t.element_size() for _, t in bucket
    )
    assert (
        packed.arrays[0].ctypes.data == bucket[0][1].data_ptr()
    )  # packing a contiguous tensor copies nothing
    fetched = ray_local.get(ray_local.put(packed))
    assert not fetched.arrays[0].flags.writeable  # Ray's zero-copy read of shared memory
    restored = fetched.tensors()
    assert [n for n, _ in restored] == ["a", "b", "c", "d", "e"]
    for (_, original), (_, copy), array in zip(bucket, restored, fetched.arrays):
        assert copy.dtype == original.dtype and copy.shape == original.shape and torch.equal(copy, original)
        assert copy.data_ptr() == array.ctypes.data  # a view, not a copy
