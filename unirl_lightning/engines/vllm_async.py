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
* **The prefix cache** is reset after a push when no request holds blocks (vLLM resets only then);
  with requests continuing in place, blocks cached under the old weights may serve a later prompt's
  prefix until the next reset. ``sync_mode="quiesce"`` pushes into an idle engine, where the reset
  always takes.
* A LoRA adapter is per request in vLLM, so a request keeps the adapter it started with: an adapter
  push while requests run is refused (use ``sync_mode="quiesce"`` with LoRA).

Occupancy (:meth:`AsyncVLLMEngine.occupancy`): requests submitted and not finished, capped at the
scheduler's ``max_num_seqs``, integrated over time (a request queued in vLLM counts while slots are
free, so this is an upper bound on vLLM's own running count).

The sampling, log-prob and seeding contracts are the static engine's
(:mod:`~unirl_lightning.engines.vllm`): the same per-sample seeds, so a call's samples do not depend
on the engine's batching mode.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import Coroutine, Iterable
from contextlib import contextmanager
from typing import Any

import torch

from unirl_lightning.core.seeding import derive_seeds
from unirl_lightning.engines.base import make_group
from unirl_lightning.engines.vllm import VLLMEngine
from unirl_lightning.rollout.records import FinishReason, Rollout, RolloutRequest, SamplingParams

__all__ = ["AsyncVLLMEngine", "EventLoopThread", "SyncAsyncLLM", "token_versions"]

Sample = tuple[list[int], list[float], FinishReason, list[int]]


class EventLoopThread:
    """An asyncio loop running on a daemon thread of its own; :meth:`run` waits for a coroutine there."""

    def __init__(self, name: str = "vllm-async-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


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


def token_versions(spans: Iterable[Any] | None, num_tokens: int, default: int) -> list[int]:
    """One weight version per output token from vLLM's ``weight_versions`` spans (``[start, end)``
    sampled under ``version``, a string we set from an int); ``default`` for every token when vLLM
    reported no spans.

    >>> from types import SimpleNamespace as S
    >>> token_versions([S(version="3", start=0, end=2), S(version="4", start=2, end=5)], 5, 0)
    [3, 3, 4, 4, 4]
    >>> token_versions(None, 2, 7)
    [7, 7]
    """
    if not spans:
        return [default] * num_tokens
    versions: list[int] = []
    for span in spans:
        versions += [int(span.version)] * (int(span.end) - int(span.start))
    if len(versions) != num_tokens:
        raise RuntimeError(f"vLLM's weight-version spans cover {len(versions)} tokens of {num_tokens}")
    return versions


class AsyncVLLMEngine(VLLMEngine):
    """:class:`~unirl_lightning.engines.vllm.VLLMEngine` on vLLM's ``AsyncLLM``; see the module docstring."""

    def _start(self, kwargs: dict[str, Any]) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._pauses = 0  # nested pushes (a streamed push: begin .. finish)
        self._pause_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._live = 0
        self._row_seconds = 0.0
        self._counted_at = self._started = time.perf_counter()
        self.loop = EventLoopThread()

        async def start() -> Any:  # AsyncLLM starts its output handler on the running loop
            engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
            await engine.update_weight_version("0")  # every token stamped from the start
            return engine

        try:
            self.engine = self.loop.run(start())
        except BaseException:
            self.loop.close()
            raise
        self.slots = int(self.engine.vllm_config.scheduler_config.max_num_seqs)
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
        self._count(+1)
        final = None
        try:
            async for output in self.engine.generate(
                {"prompt_token_ids": ids}, params, request_id, lora_request=self._lora_request
            ):
                final = output
        finally:
            self._count(-1)
        if final is None or not final.finished:
            raise RuntimeError(f"vLLM's AsyncLLM ended request {request_id} without a final output")
        return final

    def _count(self, change: int) -> None:
        with self._count_lock:
            now = time.perf_counter()
            self._row_seconds += min(self._live, self.slots) * (now - self._counted_at)
            self._counted_at = now
            self._live += change

    def generate_ids(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int | None = None
    ) -> list[tuple[list[int], list[float], FinishReason]]:
        return [
            (tokens, logprobs, finish)
            for tokens, logprobs, finish, _ in self._rows(prompt_ids, sampling, seed)
        ]

    @torch.no_grad()
    def generate(self, request: RolloutRequest) -> list[list[Rollout]]:
        n = request.n
        prompts = [self.policy.prompt_ids(self.tokenizer, record) for record in request.records]
        samples = self._rows([ids for ids in prompts for _ in range(n)], request.sampling, request.seed)
        groups = []
        for index, ids in enumerate(prompts):
            part = samples[index * n : (index + 1) * n]
            oldest = min(min(versions, default=self.weight_version) for *_, versions in part)
            group = make_group(request, index, ids, [s[:3] for s in part], self.tokenizer, oldest)
            for rollout, (*_, versions) in zip(group, part):
                if len(set(versions)) > 1:  # continued across a push: each token's own version
                    rollout.token_versions = list(versions)
            groups.append(group)
        return groups

    def occupancy(self) -> dict[str, float]:
        """``{"row_seconds", "seconds", "slots"}``: requests in the engine (at most ``slots``) x seconds,
        the engine's age, and the scheduler's ``max_num_seqs``."""
        with self._count_lock:
            now = time.perf_counter()
            rows = self._row_seconds + min(self._live, self.slots) * (now - self._counted_at)
        return {"row_seconds": rows, "seconds": now - self._started, "slots": float(self.slots)}

    # -- weights: loaded with the scheduler paused, requests kept ---------------------------------
    def _pause(self) -> None:
        """Pause vLLM's scheduler (``mode="keep"``: requests frozen with their KV cache); nested
        pauses (a push's begin .. finish, which may come on different threads) pause once."""
        with self._pause_lock:
            if self._pauses == 0:
                self.loop.run(self.engine.pause_generation(mode="keep", clear_cache=False))
            self._pauses += 1

    def _resume(self) -> None:
        """The last resume tells vLLM the version the weights now are, then resumes every request."""
        with self._pause_lock:
            self._pauses -= 1
            if self._pauses == 0:
                self.loop.run(self.engine.update_weight_version(str(self.weight_version)))
                self.loop.run(self.engine.resume_generation())

    @contextmanager
    def _paused(self):
        self._pause()
        try:
            yield
        finally:
            self._resume()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> None:
        with self._paused():
            super().load_weights(named_tensors, weight_version)

    def begin_weight_load(self) -> None:
        self._pause()
        try:
            super().begin_weight_load()
        except BaseException:
            self._resume()
            raise

    def finish_weight_load(self, weight_version: int | None) -> None:
        try:
            super().finish_weight_load(weight_version)
        finally:
            self._resume()

    def receive_weights(self, layout: Any, dtypes: Any, weight_version: int) -> None:
        with self._paused():
            super().receive_weights(layout, dtypes, weight_version)

    def _load_lora(self, items: list[tuple[str, torch.Tensor]], weight_version: int) -> None:
        if self._live:
            raise RuntimeError(
                f"a LoRA adapter push (weight_version {weight_version}) reached the continuous vLLM engine with "
                f"{self._live} request(s) in flight: vLLM binds an adapter to a request when it starts, so they "
                "cannot continue under the new one; use sync_mode='quiesce' with LoRA"
            )
        super()._load_lora(items, weight_version)
