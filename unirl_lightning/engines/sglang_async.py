"""The SGLang engine with continuous batching (``SGLangEngineConfig(batching="continuous")``): the
offline ``sglang.Engine`` created on an asyncio loop thread of the rollout worker and driven there.

Written against SGLang 0.5.23's source and tested here against a stand-in (SGLang has no CPU build);
it has not run on a GPU.

* **One loop.** SGLang's tokenizer manager binds its locks, conditions and output reader to the loop
  that first runs it, and the Engine's synchronous methods call ``loop.run_until_complete`` on it. The
  engine is therefore created on a loop thread (:class:`~unirl_lightning.engines.streaming.EventLoopThread`)
  and its ``loop`` replaced by :class:`ThreadsafeLoop`, whose ``run_until_complete`` hands the
  coroutine to that thread and waits: every synchronous call of the static engine (weights, LoRA,
  sleep, flush) then works from any worker thread, while generation runs there concurrently.
* **Calls join the running batch.** Every sample is its own ``Engine.async_generate`` request, added
  the moment its call arrives (a threaded Ray actor takes ``concurrent_calls`` calls at once).
* **Weights land without draining.** A push pauses the scheduler in place
  (``pause_generation(mode="in_place")``: the running batch and its KV cache stay), loads the buckets
  in one weight-update session without flushing the cache while requests are live (SGLang refuses a
  flush with a running batch), tells SGLang the new version
  (``update_weight_version(abort_all_requests=False)``) and continues every request in place.
* **The radix cache never serves a request KV of other weights.** Every request carries SGLang's
  ``cache_salt`` named by the weight version current when it is added (``"w<version>"``; SGLang keys
  its radix tree by it), so a prefix cached before a push (a chat template's system prompt, a group's
  prompt) never serves a request added after it: the flush with the last bucket takes only when no
  request runs, which a streaming engine kept full seldom reaches.
* **Every token keeps its version.** SGLang's scheduler records, at each version change, how many
  tokens each live request has, and a finished request reports the spans
  (``meta_info["weight_versions"]``). SGLang's overlap scheduler would process one decode step
  sampled under the old weights only after the resume, stamping its tokens with the new version, so the
  continuous engine runs with ``disable_overlap_schedule=True`` unless ``engine_kwargs`` says otherwise.
* A LoRA adapter is per request, so an adapter push while requests run is refused (use
  ``sync_mode="quiesce"`` with LoRA), as on vLLM.

Sampling, log-probs, stop rules and seeds are the static engine's (:mod:`~unirl_lightning.engines.sglang`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from contextlib import contextmanager
from typing import Any

import torch

from unirl_lightning.engines.sglang import SGLangEngine, sglang_completion
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
from unirl_lightning.rollout.records import SamplingParams

__all__ = ["AsyncSGLangEngine", "ThreadsafeLoop"]


class ThreadsafeLoop:
    """Stands in for ``sglang.Engine.loop``: ``run_until_complete`` runs the coroutine on the loop
    thread and waits, from whichever thread calls it."""

    def __init__(self, thread: EventLoopThread) -> None:
        self.thread = thread

    def run_until_complete(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.thread.run(coro)


def running_request_slots(engine: Any, default: int) -> int:
    """SGLang's cap on running requests as its scheduler sized it (the server info's
    ``internal_states[0]["effective_max_running_requests_per_dp"]``; its top-level
    ``max_running_requests`` is the launch argument, None unless set), or ``default`` when it reports
    neither."""
    info = engine.get_server_info()
    states = info.get("internal_states") or [{}]
    for value in (states[0].get("effective_max_running_requests_per_dp"), info.get("max_running_requests")):
        if isinstance(value, int) and value > 0:
            return value
    return default


class AsyncSGLangEngine(StreamedRows, SGLangEngine):
    """:class:`~unirl_lightning.engines.sglang.SGLangEngine` on a loop thread; see the module docstring."""

    def _start(self, kwargs: dict[str, Any]) -> Any:
        import sglang
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        kwargs = {"disable_overlap_schedule": True, **kwargs}
        self.loop = EventLoopThread("sglang-async-loop")
        self._pause = NestedPause(self._pause_engine, self._resume_engine)
        try:
            engine = self.loop.call(lambda: sglang.Engine(**kwargs))  # binds to the running loop
            engine.loop = ThreadsafeLoop(self.loop)
            version = UpdateWeightVersionReqInput(new_version="0", abort_all_requests=False)
            self.loop.run(engine.tokenizer_manager.update_weight_version(version))  # stamped from the start
        except BaseException:
            self.loop.close()
            raise
        self.rows = RowCounter(running_request_slots(engine, self.config.concurrent_calls))
        return engine

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.loop.close()

    # -- generation ------------------------------------------------------------------------------
    def _rows(self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int | None) -> list[Sample]:
        """Every row as its own request, all added at once to the running engine; waits for them."""
        stop_ids, params = self._requests(prompt_ids, sampling, seed)
        submitted_under = self.weight_version
        outputs = self.loop.run(self._gather(prompt_ids, params, self._lora_name))
        samples = []
        for output in outputs:
            tokens, logprobs, finish = sglang_completion(output, stop_ids)
            reported = len(output["meta_info"]["output_token_logprobs"])  # before the cut at a stop
            spans = output["meta_info"].get("weight_versions")
            versions = token_versions(spans, reported, submitted_under)[: len(tokens)]
            samples.append((tokens, logprobs, finish, versions))
        return samples

    async def _gather(
        self, prompt_ids: list[list[int]], params: list[dict[str, Any]], lora: str | None
    ) -> list:
        return list(await asyncio.gather(*(self._one(ids, p, lora) for ids, p in zip(prompt_ids, params))))

    async def _one(self, ids: list[int], params: dict[str, Any], lora: str | None) -> dict[str, Any]:
        self.rows.add(+1)
        try:
            return await self.engine.async_generate(
                input_ids=ids,
                sampling_params=params,
                return_logprob=True,
                lora_path=lora,
                cache_salt=cache_salt(self.weight_version),
            )
        finally:
            self.rows.add(-1)

    # -- weights: loaded with the scheduler paused in place ----------------------------------------
    def _pause_engine(self) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        self.loop.run(
            self.engine.tokenizer_manager.pause_generation(PauseGenerationReqInput(mode="in_place"))
        )

    def _resume_engine(self) -> None:
        """Tell SGLang the version the weights now are (no request aborted), then continue in place."""
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput, UpdateWeightVersionReqInput

        manager = self.engine.tokenizer_manager
        version = UpdateWeightVersionReqInput(new_version=str(self.weight_version), abort_all_requests=False)
        self.loop.run(manager.update_weight_version(version))
        self.loop.run(manager.continue_generation(ContinueGenerationReqInput()))

    @contextmanager
    def paused(self):
        """The static engine's pause (a retract) becomes an in-place pause, nested once per push."""
        with self._pause:
            yield

    def _load_full(self, items: list[tuple[str, torch.Tensor]], flush_cache: bool = True) -> None:
        super()._load_full(items, flush_cache=flush_cache and self.rows.live == 0)

    def _load_lora(self, items: list[tuple[str, torch.Tensor]], weight_version: int) -> None:
        refuse_lora_in_flight("SGLang", self.rows.live, weight_version)
        super()._load_lora(items, weight_version)

    def sleep(self) -> None:
        """Refused while requests run: SGLang releases its memory only when idle, and asserts it in the
        scheduler process (which would die) rather than answering the caller."""
        if self.rows.live:
            raise RuntimeError(
                f"the SGLang engine cannot sleep with {self.rows.live} request(s) running: SGLang releases "
                "its memory only when idle (placement='colocate' sleeps between steps, with nothing in flight)"
            )
        super().sleep()
