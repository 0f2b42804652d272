"""The HF engine with continuous batching (``HFEngineConfig(batching="continuous")``).

Every ``generate`` call (one request: its records' ``n`` samples each) queues its rows in one
:class:`~unirl_lightning.engines.batcher.ContinuousBatcher`, which a background thread steps while
rows are queued or decoding, and waits for its own rows only. Calls that arrive while others run (a
threaded Ray actor takes ``concurrent_calls`` of them at once) join the running batch as slots free:
the engine stays full across requests instead of each ``generate`` lasting as long as its longest row.

Weights: a load (whole, bucketed or shared) takes the step lock, so it lands between two decode
steps; rows in flight then continue in place under the new weights (their KV cache as it was, as
PipelineRL's in-flight update does), and every token keeps the version it was sampled under
(``Rollout.token_versions``). The rollout runtime's default sync still quiesces first, so a load
normally finds the engine idle.

Occupancy: :meth:`ContinuousHFEngine.occupancy` reports the engine's active-row-seconds and wall
seconds so far (time-averaged active rows / slots is their ratio over ``max_batch_size`` slots).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from unirl_lightning.core.seeding import derive_seed
from unirl_lightning.engines.batcher import BatchRow, ContinuousBatcher
from unirl_lightning.engines.hf import HFEngine
from unirl_lightning.rollout.records import Rollout, RolloutRequest

__all__ = ["ContinuousHFEngine"]


class ContinuousHFEngine(HFEngine):
    """:class:`~unirl_lightning.engines.hf.HFEngine` whose ``generate`` runs through a continuously
    batching background loop (see the module docstring); the log-prob contract is the HF engine's."""

    def __init__(self, config: Any, policy: Any, lora: Any) -> None:
        super().__init__(config, policy, lora)
        self._lock = threading.RLock()  # one decode step, or one weight load, at a time
        self._work = threading.Condition()
        self._closed = False
        self._held = 0  # streamed weight loads under way (begin_weight_load .. finish_weight_load)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._threads = torch.get_num_threads()  # set for this thread by engine_device; the loop's own
        self.batcher = ContinuousBatcher(
            self.model,
            self.device,
            stop_ids=list(self.stop_ids),
            pad_id=self.tokenizer.pad_token_id,
            max_rows=config.max_batch_size,
            max_positions=self.max_positions if isinstance(self.max_positions, int) else None,
            tokenizer=self.tokenizer,
            version=lambda: self.weight_version,
            share_prompts=config.share_prompt_prefill,
        )

    # -- the background loop ---------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="hf-continuous-batching", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        torch.set_num_threads(self._threads)  # intra-op threads are set per thread: as the engine's
        while True:
            with self._work:
                while not self._closed and (self._held or not self.batcher.pending):
                    self._work.wait()
                if self._closed:
                    return
            try:
                with self._lock:
                    if not self._held:  # checked under the lock: a streamed load is never split by a step
                        self.batcher.step()
            except BaseException as error:  # noqa: BLE001 - every waiting call gets it
                self._fail(error)

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The step lock, taken ahead of the loop: the loop finishes the step it is in and waits until
        this caller is done. A plain lock is not fair: the loop takes it again between two steps before
        a waiting caller wakes, so a weight push or a submit could wait out many steps (on the long-tail
        workload, 43 ms a push against 7 ms with this hold; docs/engines.md)."""
        with self._work:
            self._held += 1
        try:
            with self._lock:
                yield
        finally:
            with self._work:
                self._held -= 1
                self._work.notify_all()

    def _fail(self, error: BaseException) -> None:
        """End every queued and decoding row with ``error`` (each waiting call raises it)."""
        with self._lock:
            self._error = error
            self.batcher.abort(lambda row: True)
            self._error = None

    # -- generation ------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, request: RolloutRequest) -> list[list[Rollout]]:
        prompts = [self.policy.prompt_ids(self.tokenizer, record) for record in request.records]
        done = threading.Event()
        remaining = [len(prompts) * request.n]
        errors: list[BaseException] = []

        def finished(row: BatchRow) -> None:
            if self._error is not None:
                errors.append(self._error)
            remaining[0] -= 1
            if remaining[0] == 0:
                done.set()

        rows = [
            [
                BatchRow(
                    ids,
                    request.sampling,
                    seed=None if request.seed is None else derive_seed(request.seed, index, sample),
                    on_finish=finished,
                )
                for sample in range(request.n)
            ]
            for index, ids in enumerate(prompts)
        ]
        if not remaining[0]:
            return []
        # closed is read under the step lock: close() aborts every row added before it
        with self._exclusive():
            if self._closed:
                raise RuntimeError("the HF engine was closed")
            for group in rows:
                for row in group:
                    self.batcher.add(row)
            self._ensure_thread()
        done.wait()
        if errors:
            raise errors[0]
        return [self._group(request, index, prompts[index], group) for index, group in enumerate(rows)]

    def _group(
        self, request: RolloutRequest, index: int, prompt: list[int], rows: list[BatchRow]
    ) -> list[Rollout]:
        from unirl_lightning.engines.base import make_group

        group = make_group(
            request,
            index,
            prompt,
            [(row.tokens, row.logprobs, row.finish_reason) for row in rows],
            self.tokenizer,
            min((min(row.versions) for row in rows if row.versions), default=self.weight_version),
        )
        for rollout, row in zip(group, rows):
            if len(set(row.versions)) > 1:  # continued across a weight load: each token's own version
                rollout.token_versions = list(row.versions)
        return group

    def occupancy(self) -> dict[str, float]:
        """``{"row_seconds", "seconds", "slots", "busy_seconds", "steps", "starved_slot_seconds"}``:
        active rows x seconds summed over decode steps, the engine's age in seconds, its slots
        (``max_batch_size``), the seconds and count of the loop's steps that produced a token (their
        ratio is the mean step time; busy over age is the share of the time the loop was stepping), and
        the free slots x seconds while no row was queued (the engine waited on its callers)."""
        return {
            "row_seconds": self.batcher.row_seconds,
            # as of the last counted step: a report read while a step runs stays consistent
            "seconds": self.batcher.counted_at - self._started,
            "slots": float(self.batcher.max_rows),
            "busy_seconds": self.batcher.busy_seconds,
            "steps": float(self.batcher.steps),
            "starved_slot_seconds": self.batcher.starved_slot_seconds,
        }

    # -- weights: loaded between two decode steps ------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> None:
        with self._exclusive():
            super().load_weights(named_tensors, weight_version)

    def share_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> int:
        with self._exclusive():
            return super().share_weights(named_tensors, weight_version)

    def begin_weight_load(self) -> None:
        with self._work:
            self._held += 1  # no step runs until finish_weight_load (the calls may come on other threads)
        with self._lock:
            super().begin_weight_load()

    def load_weight_bucket(self, named_tensors: Any) -> None:
        with self._lock:
            super().load_weight_bucket(named_tensors)

    def finish_weight_load(self, weight_version: int | None) -> None:
        try:
            with self._lock:
                super().finish_weight_load(weight_version)
        finally:
            with self._work:
                self._held = max(0, self._held - 1)
                self._work.notify_all()

    def generate_ids(self, prompt_ids, sampling, seed=None):  # the agentic entry point: one call at a time
        with self._exclusive():
            return super().generate_ids(prompt_ids, sampling, seed)

    def sleep(self) -> None:
        with self._exclusive():
            super().sleep()

    def wake(self, tags: list[str] | None = None) -> None:
        with self._exclusive():
            super().wake(tags)

    def close(self) -> None:
        with self._work:
            self._closed = True
            self._work.notify_all()
        self._fail(RuntimeError("the HF engine was closed while generating"))
        super().close()
