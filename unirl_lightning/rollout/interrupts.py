"""Interruptible batch generation (``sync_mode="interrupt"``): chunked jobs, and the suspended map.

Who calls it
    :class:`~unirl_lightning.rollout.controller.BatchRolloutController` keeps a
    :class:`SuspendedJobs` and moves jobs into it at ``quiesce(interrupt=True)`` and back at
    ``resume``; the batch runtime wraps each launch in a :class:`ChunkedGeneration` (its
    ``launch``) when the strategy says ``sync_mode="interrupt"``. The property test and the
    simulator drive the same classes with simulated generations.

Mechanism (the same for every token engine)
    A job's samples are generated in *chunks* of at most ``chunk_tokens`` new tokens per row. A call
    is one ordinary, non-blocking launch whose request carries every unfinished row's partial
    completion (:class:`~unirl_lightning.rollout.records.PartialRow`); the worker generates chunk
    after chunk, continuing each row from prompt + partial, until the job is done or the request's
    interrupt signal fires (checked between chunks: a worker actor runs one call at a time, so an
    abort *call* would queue behind ``generate``). A resumed row's prefix is re-encoded as prompt,
    so its KV cache is recomputed with the weights the engine holds now. Without a signal a call is
    one chunk and the handle launches the next itself. An *interrupt* bumps the signal, waits for the
    calls in flight (each ends at its chunk boundary: at most ``chunk_tokens`` decode steps, instead
    of the longest sample's tail) and launches no next call:
    the job is suspended with its partial samples, leaves the in-flight pool (so ``sync_weights``'
    refusal while anything is in flight stays literally true) and keeps its ``gen_id`` and launch
    stamp. ``resume`` after the push launches the next chunk with the new weights.

What it guarantees
    * Every token carries the weight version the engine reported when it generated it, and its own
      behaviour log-prob: a sample's ``completion_ids``, ``logprobs`` and ``token_versions`` are
      extended together, chunk by chunk, and a fold that raises changes nothing.
    * The launch stamp is never newer than a sample's oldest token (nothing syncs while a chunk is
      in flight, so the first chunk runs under the launch version): today's eviction by launch
      stamp already bounds ``current - oldest token version``. A suspended job whose oldest token
      would be over ``max_staleness`` at resume is dropped and counted, never resumed or trained.
    * ``result()`` is the job's whole result (every row finished, scored by the worker in the chunk
      it finished in), shaped as an unchunked generation's: ``groups``, ``generate_s``, ``score_s``
      (sums over chunks) and ``spans`` (one per chunk part; ``chunk`` and ``interrupted`` added).

This module imports only the standard library and the package's stdlib-only records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from unirl_lightning.core.seeding import derive_seed
from unirl_lightning.rollout.records import GenerationResult, PartialRow, RolloutRequest

__all__ = ["ChunkedGeneration", "SuspendedJobs", "chunked_launch"]

Key = tuple[int, int]  # (record index in the job's request, sample index)


class ChunkedGeneration:
    """A :class:`~unirl_lightning.rollout.controller.GenerationHandle` over a job generated chunk by
    chunk (see the module docstring), and interruptible between chunks.

    Args:
        launch: ``launch(request) -> handle``: starts one chunk without blocking (the worker group's
            ``generate``); its result has ``groups`` of rollouts, one per row sent, in row order.
        request: the job's request (``n`` samples of each record, its sampling and seed).
        chunk_tokens: the most new tokens of a row per chunk.
        signal: the interrupt signal (``epoch``, ``bump()``; the worker reads ``fired(epoch)``):
            with one, a call goes on chunk after chunk in the worker until the job finishes or a
            sync bumps the signal; None = one chunk per call, the next launched by this handle.

    Raises ``ValueError`` if ``chunk_tokens < 1``; whatever ``launch`` raises (from the constructor
    for the first chunk, then from ``ready``/``wait``/``result``/``resume``, the job unchanged).
    """

    def __init__(
        self, launch: Callable[[Any], Any], request: RolloutRequest, chunk_tokens: int, signal: Any = None
    ) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self._launch = launch
        self.request = request
        self.chunk_tokens = chunk_tokens
        self.signal = signal
        self.rows: dict[Key, PartialRow] = {
            (index, sample): PartialRow(sample)
            for index in range(len(request.records))
            for sample in range(request.n)
        }
        self.done: dict[Key, Any] = {}
        self.chunks = 0  # chunks folded so far
        self.interrupts = 0  # times this job was suspended and resumed
        self.generate_s = self.score_s = 0.0
        self.reward_timeouts = 0
        self.spans: list[dict[str, Any]] = []
        self._stopped = False  # interrupted: no next chunk until resume
        self._sent: list[Key] = []
        self._pending: Any = None
        self._relaunch()

    # -- state ----------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """Every row of the job has finished (stop token, stop string or its whole budget)."""
        return not self.rows

    def oldest_token_version(self) -> int | None:
        """The version of the oldest token of the job's unfinished rows, None when they have none."""
        versions = [row.token_versions[0] for row in self.rows.values() if row.token_versions]
        return min(versions) if versions else None

    def partial_samples(self) -> int:
        """Unfinished rows that already hold tokens (what a checkpoint drops: they relaunch from the prompt)."""
        return sum(1 for row in self.rows.values() if row.completion_ids)

    # -- chunks ---------------------------------------------------------------------------------
    def _chunk_request(self) -> RolloutRequest:
        by_record: dict[int, list[PartialRow]] = {}
        self._sent = sorted(self.rows)
        for index, sample in self._sent:
            by_record.setdefault(index, []).append(self.rows[index, sample])
        records = sorted(by_record)
        seed = self.request.seed
        return dataclasses.replace(
            self.request,
            records=[self.request.records[i] for i in records],
            partial=[by_record[i] for i in records],
            chunk_tokens=self.chunk_tokens,
            seed=None if seed is None else derive_seed(seed, self.chunks),
            interrupt_signal=self.signal,
            interrupt_epoch=0 if self.signal is None else self.signal.epoch,
        )

    def _relaunch(self) -> None:
        if self._pending is None and self.rows and not self._stopped:
            self._pending = self._launch(self._chunk_request())

    def _fold(self, interrupted: bool = False) -> None:
        """Fold the finished chunk into the job (complete-or-nothing), then forget its handle;
        ``interrupted``: the chunk ends at an interrupt (its spans say so when rows stay unfinished)."""
        result = self._pending.result()
        returned = [rollout for group in result.groups for rollout in group]
        if len(returned) != len(self._sent):
            raise RuntimeError(
                f"chunk {self.chunks} of gen_id {self.request.gen_id} returned {len(returned)} rows for "
                f"{len(self._sent)} sent"
            )
        rows, done = dict(self.rows), dict(self.done)
        for key, rollout in zip(self._sent, returned):
            if rollout.finish_reason == "aborted":
                rows[key] = PartialRow(
                    key[1], list(rollout.completion_ids), list(rollout.logprobs), list(rollout.versions())
                )
            else:
                del rows[key]
                done[key] = rollout
        cut = interrupted and bool(rows)
        spans = [{**span, "chunk": self.chunks, "interrupted": cut} for span in result.spans]
        self.rows, self.done = rows, done
        self.generate_s += result.generate_s
        self.score_s += result.score_s
        self.reward_timeouts += result.reward_timeouts
        self.spans.extend(spans)
        self.chunks += 1
        self._pending = None

    def _advance(self) -> bool:
        """Fold every finished chunk and launch the next; True when ``result()`` would not block."""
        while self._pending is not None and self._pending.ready():
            try:
                self._fold()
            except Exception:
                return True  # result() raises it again (the chunk's handle may retry)
            self._relaunch()
        return self._pending is None

    # -- GenerationHandle -------------------------------------------------------------------------
    def ready(self) -> bool:
        """True once the job is finished (or a chunk's result would raise); launches chunks as they end."""
        self._relaunch()
        return self._advance()

    def wait(self) -> None:
        """Block until the job is finished (chunk after chunk), or until the chunk in flight ended when
        interrupted; errors are left for ``result()``."""
        self._relaunch()
        while self._pending is not None:
            self._pending.wait()
            if self._advance() and self._pending is not None:
                return  # a failed chunk: result() raises

    def result(self) -> GenerationResult:
        """The job's whole result (see the module docstring); raises the failure of a chunk, and
        ``RuntimeError`` for a suspended job (resume it first)."""
        self._relaunch()
        while self._pending is not None:
            self._pending.wait()
            self._fold()
            self._relaunch()
        if self.rows:
            raise RuntimeError(
                f"gen_id {self.request.gen_id} is suspended with {len(self.rows)} unfinished sample(s): "
                "resume it after the weight push"
            )
        groups = [
            [self.done[index, sample] for sample in range(self.request.n)]
            for index in range(len(self.request.records))
        ]
        return GenerationResult(
            groups,
            generate_s=self.generate_s,
            score_s=self.score_s,
            spans=self.spans,
            reward_timeouts=self.reward_timeouts,
        )

    # -- interrupts -------------------------------------------------------------------------------
    def interrupt(self) -> bool:
        """Launch no next chunk, wait for the one in flight and fold it; True when the job finished
        anyway (reap it), False when it is suspended with partial samples. A failing chunk raises and
        stays in flight."""
        if self._pending is not None:
            self._pending.wait()
            self._fold(interrupted=True)
        self._stopped = True
        return self.finished

    def resume(self) -> None:
        """Continue a suspended job with the weights the engine holds now (the next chunk is
        launched; if that raises, the job stays suspended)."""
        self._stopped = False
        if self.rows:
            self._relaunch()
            self.interrupts += 1


def chunked_launch(
    launch: Callable[[Any], Any], chunk_tokens: int, signal: Any = None
) -> Callable[[RolloutRequest], ChunkedGeneration]:
    """The controller's ``launch`` for ``sync_mode="interrupt"``: every request becomes a
    :class:`ChunkedGeneration` over ``launch`` (e.g. the worker group's ``generate``) and ``signal``."""
    return lambda request: ChunkedGeneration(launch, request, chunk_tokens, signal)


class SuspendedJobs:
    """Jobs taken out of flight by an interrupt, keyed by ``gen_id`` with their launch stamp.

    Mechanism only, owned by the controller: ``suspend`` interrupts every interruptible job of the
    pool and moves the unfinished ones here; ``resume`` puts them back (same ``gen_id``, same stamp)
    or drops those whose oldest token would be over the staleness bound (``pop_dropped``).
    """

    def __init__(self) -> None:
        self._jobs: dict[int, tuple[int, Any]] = {}  # gen_id -> (launch stamp, handle)
        self._dropped: list[tuple[int, int]] = []  # (gen_id, launch stamp), handed out once
        self.interrupted = 0  # jobs suspended so far

    def __len__(self) -> int:
        return len(self._jobs)

    def gen_ids(self) -> list[int]:
        """The ``gen_id`` of every suspended job, oldest first."""
        return sorted(self._jobs)

    def handles(self) -> list[Any]:
        """The suspended jobs' handles, oldest first."""
        return [self._jobs[g][1] for g in sorted(self._jobs)]

    def suspend(self, pool: Any) -> None:
        """Interrupt every job of ``pool`` whose handle has ``interrupt``; move the unfinished ones here.

        Each job is tried; a job whose interrupt raised stays in flight (a following ``sync_weights``
        refuses), and the first error is raised after the sweep. Finished jobs stay in the pool for
        the reap that follows.
        """
        first_error: Exception | None = None
        signals = {
            id(h.signal): h.signal for _, _, h in pool.jobs() if getattr(h, "signal", None) is not None
        }
        for signal in signals.values():  # every request in flight stops at its next chunk boundary
            signal.bump()
        for gen_id, stamp, handle in pool.jobs():
            interrupt = getattr(handle, "interrupt", None)
            if interrupt is None:
                continue
            try:
                if interrupt():
                    continue
            except Exception as error:
                first_error = first_error or error
                continue
            pool.remove(gen_id)
            self._jobs[gen_id] = (stamp, handle)
            self.interrupted += 1
        if first_error is not None:
            raise first_error

    def resume(self, pool: Any, weight_version: int, max_staleness: int | None) -> int:
        """Resume every suspended job in ``gen_id`` order under ``weight_version`` (put back in ``pool``
        with its gen_id and stamp); a job with ``weight_version - oldest token version > max_staleness``
        is dropped instead. Returns how many were resumed. A job whose resume raised stays suspended;
        the first error is raised after the sweep."""
        first_error: Exception | None = None
        resumed = 0
        for gen_id in sorted(self._jobs):
            stamp, handle = self._jobs[gen_id]
            oldest = handle.oldest_token_version()
            oldest = stamp if oldest is None else oldest
            if oldest < stamp:
                raise RuntimeError(
                    f"gen_id {gen_id} holds a token of version {oldest}, older than its launch stamp {stamp}"
                )
            if max_staleness is not None and weight_version - oldest > max_staleness:
                del self._jobs[gen_id]
                self._dropped.append((gen_id, stamp))
                continue
            try:
                handle.resume()
            except Exception as error:
                first_error = first_error or error
                continue
            del self._jobs[gen_id]
            pool.add(gen_id, stamp, handle)
            resumed += 1
        if first_error is not None:
            raise first_error
        return resumed

    def pop_dropped(self) -> list[tuple[int, int]]:
        """``(gen_id, launch stamp)`` of every job dropped as over-stale since the last call, once."""
        dropped, self._dropped = self._dropped, []
        return dropped
