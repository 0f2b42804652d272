"""VLLMEngineConfig checks that need vLLM itself (the rest run everywhere: tests/unit/test_serving_config.py)."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm runs these in .venv-vllm)")

from unirl_lightning.engines.vllm import VLLMEngineConfig  # noqa: E402
from unirl_lightning.models.causal_lm import TinyCausalLM  # noqa: E402


def test_cpu_head_size_vllm_cannot_run_is_rejected_before_start():
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the head-size check is for vLLM's CPU attention")
    with pytest.raises(ValueError, match="head sizes .* head size 16"):
        VLLMEngineConfig().build(TinyCausalLM(hidden_size=64, num_heads=4))
