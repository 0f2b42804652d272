"""What the engines on an asyncio server share (vLLM's ``AsyncLLM``, SGLang's tokenizer manager): the
loop thread they run on, the rule that reads a sample's per-token weight versions from the engine's
spans, the prefix-cache namespace of a request, the occupancy counter, the nested pause of a streamed
push, and the grouping of rows that carry their own versions. Imports neither engine.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import torch

from unirl_lightning.engines.base import make_group
from unirl_lightning.rollout.records import FinishReason, Rollout, RolloutRequest, SamplingParams

__all__ = [
    "EventLoopThread",
    "NestedPause",
    "RowCounter",
    "Sample",
    "StreamedRows",
    "cache_salt",
    "refuse_lora_in_flight",
    "token_versions",
    "versioned_groups",
]

Sample = tuple[list[int], list[float], FinishReason, list[int]]
"""One row: completion ids, their behaviour log-probs, finish reason, each token's weight version."""


class EventLoopThread:
    """An asyncio loop running on a daemon thread of its own; :meth:`run` waits for a coroutine there.
    An engine whose objects bind to the loop that first runs them (both servers' do) is created and
    driven only through :meth:`run`."""

    def __init__(self, name: str = "engine-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """``fn()`` on the loop's thread (for a synchronous call that must run there); its result."""

        async def wrapped() -> Any:
            return fn()

        return self.run(wrapped(), timeout)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def _field(span: Any, name: str) -> Any:
    return span[name] if isinstance(span, dict) else getattr(span, name)


def cache_salt(weight_version: int) -> str:
    """The prefix-cache namespace of a request added under ``weight_version`` (vLLM's and SGLang's
    ``cache_salt``): a request shares cached KV only with requests added under the same weights, so a
    prefix cached before a push never serves a request added after it."""
    return f"w{weight_version}"


def token_versions(spans: Iterable[Any] | None, num_tokens: int, default: int) -> list[int]:
    """One weight version per output token from an engine's weight-version spans (``[start, end)``
    sampled under ``version``, a string we set from an int; objects as vLLM's ``CompletionOutput``
    carries them or dicts as SGLang's ``meta_info`` does); ``default`` for every token when the engine
    reported none.

    >>> from types import SimpleNamespace as S
    >>> token_versions([S(version="3", start=0, end=2), S(version="4", start=2, end=5)], 5, 0)
    [3, 3, 4, 4, 4]
    >>> token_versions([{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 1, "end": 2}], 2, 0)
    [1, 2]
    >>> token_versions(None, 2, 7)
    [7, 7]
    """
    if not spans:
        return [default] * num_tokens
    versions: list[int] = []
    for span in spans:
        start, end = int(_field(span, "start")), int(_field(span, "end"))
        versions += [int(_field(span, "version"))] * (end - start)
    if len(versions) != num_tokens:
        raise RuntimeError(f"the engine's weight-version spans cover {len(versions)} tokens of {num_tokens}")
    return versions


class RowCounter:
    """Rows submitted to the engine and not finished, capped at its ``slots``, integrated over time:
    the ``occupancy`` counters the rollout loop turns into ``rollout/engine_occupancy`` (a row queued
    inside the engine counts while slots are free, so this bounds the engine's own running count from
    above)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.live = 0
        self._lock = threading.Lock()
        self._row_seconds = 0.0
        self._counted_at = self._started = time.perf_counter()

    def add(self, change: int) -> None:
        with self._lock:
            now = time.perf_counter()
            self._row_seconds += min(self.live, self.slots) * (now - self._counted_at)
            self._counted_at = now
            self.live += change

    def occupancy(self) -> dict[str, float]:
        """``{"row_seconds", "seconds", "slots", "starved_slot_seconds"}``: rows in the engine (at most
        ``slots``) x seconds, the counter's age, the slots, and the free slots x seconds (a row queued
        in the engine counts as in a slot, so every free slot is one with nothing queued)."""
        with self._lock:
            now = time.perf_counter()
            rows = self._row_seconds + min(self.live, self.slots) * (now - self._counted_at)
        seconds = now - self._started
        return {
            "row_seconds": rows,
            "seconds": seconds,
            "slots": float(self.slots),
            "starved_slot_seconds": self.slots * seconds - rows,
        }


class NestedPause:
    """Pauses an engine once for nested pauses (a streamed push's begin .. finish may come on different
    threads): ``pause()`` runs on the first enter, ``resume()`` on the last exit."""

    def __init__(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self._pause, self._resume = pause, resume
        self._depth = 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._pause()
            self._depth += 1

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._resume()

    def __enter__(self) -> NestedPause:
        self.enter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.exit()


def versioned_groups(
    request: RolloutRequest, prompts: list[list[int]], samples: list[Sample], tokenizer: Any, current: int
) -> list[list[Rollout]]:
    """One group per record from its ``n`` rows (in order): the group is stamped with its oldest
    token's version (``current`` for a group with no token), and a sample whose tokens span a push
    carries each token's version as ``Rollout.token_versions``."""
    n = request.n
    groups = []
    for index, ids in enumerate(prompts):
        part = samples[index * n : (index + 1) * n]
        oldest = min(min(versions, default=current) for *_, versions in part)
        group = make_group(request, index, ids, [s[:3] for s in part], tokenizer, oldest)
        for rollout, (*_, versions) in zip(group, part):
            if len(set(versions)) > 1:
                rollout.token_versions = list(versions)
        groups.append(group)
    return groups


class StreamedRows:
    """The generation entry points of an engine whose ``_rows(prompt_ids, sampling, seed)`` returns one
    :data:`Sample` per row and whose ``rows`` is a :class:`RowCounter` (put first among the bases)."""

    def generate_ids(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int | None = None
    ) -> list[tuple[list[int], list[float], FinishReason]]:
        return [sample[:3] for sample in self._rows(prompt_ids, sampling, seed)]  # type: ignore[attr-defined]

    @torch.no_grad()
    def generate(self, request: RolloutRequest) -> list[list[Rollout]]:
        tok, policy = self.tokenizer, self.policy  # type: ignore[attr-defined]
        prompts = [policy.prompt_ids(tok, record) for record in request.records]
        rows = [ids for ids in prompts for _ in range(request.n)]
        samples = self._rows(rows, request.sampling, request.seed)  # type: ignore[attr-defined]
        return versioned_groups(request, prompts, samples, tok, self.weight_version)  # type: ignore[attr-defined]

    def occupancy(self) -> dict[str, float]:
        """Rows in the engine (at most its slots) x seconds; see :class:`RowCounter`."""
        return self.rows.occupancy()  # type: ignore[attr-defined]


def refuse_lora_in_flight(engine: str, live: int, weight_version: int) -> None:
    """An adapter push while requests run cannot take (both servers bind an adapter to a request when
    it starts): refused, naming the way out."""
    if live:
        raise RuntimeError(
            f"a LoRA adapter push (weight_version {weight_version}) reached the continuous {engine} engine with "
            f"{live} request(s) in flight: {engine} binds an adapter to a request when it starts, so they "
            "cannot continue under the new one; use sync_mode='quiesce' with LoRA"
        )
