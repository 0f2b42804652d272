"""Settings for the vLLM engine tests (``make test-vllm``: a real vLLM, the CPU build, in .venv-vllm).

Every test module here starts with ``pytest.importorskip("vllm")``, so the main suite, whose venv has
no vLLM, skips them at collection. Nothing here imports vllm; helpers are in ``helpers.py``, the
``ray_local`` fixture in ``tests/conftest.py``.
"""

from __future__ import annotations

import os

# vLLM's engine core in the calling process: starts in ~2 s instead of ~18 s (set before ray starts,
# so Ray's workers inherit it); quiet vLLM's per-call INFO lines.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
