"""Batch rollout controller: in-flight bookkeeping, weight-version stamps, buffering and eviction.

Who calls it
    The driver-side ``RolloutLoop`` (training *policy*: when to launch, poll, drain) and the
    weight-sync callback (when to ``quiesce`` and ``sync_weights``). The controller itself is
    *mechanism*: it never decides when anything happens, and it never calls
    :func:`launch_ceiling`, which is the one shared piece of batch policy and lives here only so
    that the formula exists exactly once.

What it guarantees
    * ``submit`` hands out consecutive ``gen_id`` values starting at ``start_gen_id`` and stamps
      each job with the weight version current *at launch* (launch-time stamps).
    * Reaping is complete-or-nothing per job: a job leaves the in-flight pool, and its groups
      enter the buffer, only if both ``pending.result()`` and ``complete(...)`` returned. A job
      whose reap raised stays in flight, so a later ``poll`` retries it and inserts its groups
      exactly once. Every ready job is attempted in one sweep; the first ``Exception`` is
      re-raised after the sweep and later ones are logged. ``KeyboardInterrupt`` and other
      ``BaseException`` subclasses pass straight through, leaving the job being reaped in flight.
    * ``drain_freshest(n, max_staleness)`` first evicts every buffered group whose
      ``weight_version < weight_version_now - max_staleness`` (handed out once by
      ``pop_evicted``), then either returns exactly ``n`` groups, freshest version first and in
      insertion order within a version, or returns ``None`` and consumes nothing.
    * ``require_idle()`` refuses (``RuntimeError``) while anything is in flight, and
      ``advance_version()`` bumps the version after a push (the runtime's sync: quiesce,
      ``require_idle``, push, ``advance_version``; a push that raised leaves the version as it was).
    * ``quiesce(interrupt=True)`` / ``resume(max_staleness)`` (``sync_mode="interrupt"``, see
      :mod:`~unirl_lightning.rollout.interrupts`): interrupted jobs wait out of flight, keeping their
      gen_id and launch stamp, and come back after the push, or are dropped (``pop_dropped``) when
      their oldest token would be over the bound.

What raises
    * ``ValueError`` for impossible arguments (``n <= 0``, ``max_inflight <= 0``,
      ``max_staleness < 0``, and the ``launch_ceiling`` arguments), naming the argument, the
      value seen and the rule.
    * ``RuntimeError`` from ``drain_freshest`` when fewer than ``n`` groups are buffered and
      nothing is in flight (the request can never be satisfied), and from ``require_idle`` while
      jobs are in flight.
    * Whatever ``launch``, ``pending.result()``, ``complete`` or ``push`` raise, with the state
      left as if the failing call had not been made.

This module imports only the standard library (and the package's stdlib-only ``checks``): the training driver imports it without torch or ray.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from unirl_lightning.core.checks import require_at_least
from unirl_lightning.rollout.interrupts import SuspendedJobs
from unirl_lightning.rollout.pool import (
    Complete,
    GenerationHandle,
    InflightPool,
    StampedGroup,
    VersionedBuffer,
    VersionLedger,
)

__all__ = [
    "BatchRolloutController",
    "InflightPool",
    "GenerationHandle",
    "StampedGroup",
    "VersionedBuffer",
    "admit_groups",
    "launch_ceiling",
]

logger = logging.getLogger(__name__)


def _one_group(gen_id: int, weight_version: int, result: Any) -> list[Any]:
    return [result]


class BatchRolloutController(VersionLedger):
    """Async batch generation: launch jobs, reap them as they finish, hand out the freshest groups.

    Args:
        launch: ``launch(request) -> GenerationHandle``; starts one generation without blocking.
        complete: ``complete(gen_id, weight_version, result) -> groups``; turns one finished
            generation into the groups to buffer (default: the result is one group; a
            :class:`~unirl_lightning.rollout.loop.RolloutLoop` sets its own with
            :meth:`complete_with`). Do every fallible step here before touching outside state: a
            raise leaves the job in flight and it is completed again on the next ``poll``.
        start_gen_id: the first ``gen_id`` handed out (e.g. the resume step).
        start_weight_version: the weight version the generators hold now.

    Example::

        controller = BatchRolloutController(launch=workers.generate_nowait)
        controller.launch_until(launch_ceiling(step, sync_interval, max_staleness, num_rollouts),
                                max_inflight=2, build=lambda gen_id: prompts[gen_id])
        controller.poll()
        batch = controller.drain_freshest(groups_per_step, max_staleness=1)
    """

    def __init__(
        self,
        launch: Callable[[Any], GenerationHandle],
        complete: Complete | None = None,
        start_gen_id: int = 0,
        start_weight_version: int = 0,
    ) -> None:
        require_at_least("start_gen_id", start_gen_id, 0)
        require_at_least("start_weight_version", start_weight_version, 0)
        self._launch = launch
        self._complete: Complete = complete if complete is not None else _one_group
        self._next_gen_id = start_gen_id
        self._weight_version = start_weight_version
        self._pool = InflightPool()
        self._buffer = VersionedBuffer()
        self._suspended = SuspendedJobs()  # interrupted jobs between quiesce and resume

    def complete_with(self, complete: Complete) -> None:
        """Set the ``complete`` hook (the loop that drives this controller sets its own)."""
        self._complete = complete

    @property
    def next_gen_id(self) -> int:
        """The ``gen_id`` the next ``submit`` will hand out."""
        return self._next_gen_id

    @property
    def inflight(self) -> int:
        """Number of launched jobs not yet reaped."""
        return len(self._pool)

    @property
    def suspended(self) -> int:
        """Number of interrupted jobs waiting for ``resume`` (not in flight)."""
        return len(self._suspended)

    @property
    def interrupted_jobs(self) -> int:
        """Jobs suspended by an interrupt so far."""
        return self._suspended.interrupted

    @property
    def buffered(self) -> int:
        """Number of groups reaped and waiting to be drained."""
        return len(self._buffer)

    def submit(self, request: Any) -> int:
        """Launch one generation stamped with the current weight version; returns its ``gen_id``.

        If ``launch`` raises, nothing is tracked and the ``gen_id`` is not used up.
        """
        pending = self._launch(request)
        gen_id = self._next_gen_id
        self._pool.add(gen_id, self._weight_version, pending)
        self._next_gen_id = gen_id + 1
        return gen_id

    def launch_until(self, gen_id_limit: int, max_inflight: int, build: Callable[[int], Any]) -> int:
        """Launch ``build(next_gen_id)`` while ``next_gen_id < gen_id_limit`` and ``inflight < max_inflight``.

        Returns how many were launched. ``gen_id_limit`` is exclusive (see :func:`launch_ceiling`).
        """
        require_at_least("max_inflight", max_inflight, 1)
        launched = 0
        while self._next_gen_id < gen_id_limit and len(self._pool) < max_inflight:
            self.submit(build(self._next_gen_id))
            launched += 1
        return launched

    def poll(self) -> int:
        """Reap every ready job without blocking; returns the number of groups inserted.

        Complete-or-nothing per job; the first failure is raised after every ready job was tried.
        """
        return self._pool.reap_ready(self._complete, self._buffer.insert)

    def wait_oldest(self) -> None:
        """Block until the oldest in-flight job has finished (reap it with ``poll``); no-op if none."""
        pending = self._pool.oldest()
        if pending is not None:
            pending.wait()

    def wait_any(self, poll_s: float = 0.002) -> None:
        """Block until some in-flight job has finished (reap it with ``poll``); no-op if none. Group
        launches finish out of order, so waiting on the oldest would idle the trainer behind one long
        group while others are done."""
        handles = [pending for _, _, pending in self._pool.jobs()]
        if len(handles) <= 1:
            self.wait_oldest()
            return
        while not any(pending.ready() for pending in handles):
            time.sleep(poll_s)

    def quiesce(self, interrupt: bool = False) -> int:
        """Wait for and reap every in-flight job in ``gen_id`` order; returns groups inserted.

        Call before ``sync_weights`` (and before eval or checkpointing). If a reap fails, the
        failing jobs stay in flight and the first error is raised after the sweep, so a following
        ``sync_weights`` still refuses. ``interrupt=True`` first interrupts every interruptible job
        (:class:`~unirl_lightning.rollout.interrupts.ChunkedGeneration`: its chunk in flight ends)
        and moves the unfinished ones out of flight into the suspended map (same gen_id, same
        stamp) until :meth:`resume`.
        """
        if interrupt:
            self._suspended.suspend(self._pool)
        return self._pool.reap_all(self._complete, self._buffer.insert)

    def resume(self, max_staleness: int | None = None) -> int:
        """Put every suspended job back in flight under the current version (after ``sync_weights``);
        one whose oldest token is over ``max_staleness`` is dropped (``pop_dropped``). Returns how
        many were resumed."""
        return self._suspended.resume(self._pool, self._weight_version, max_staleness)

    def pop_dropped(self) -> list[tuple[int, int]]:
        """``(gen_id, launch stamp)`` of every suspended job dropped as over-stale since the last call, once."""
        return self._suspended.pop_dropped()

    def partial_samples(self) -> int:
        """Unfinished samples holding tokens, in flight or suspended (a checkpoint drops them)."""
        handles = [h for _, _, h in self._pool.jobs()] + self._suspended.handles()
        return sum(h.partial_samples() for h in handles if hasattr(h, "partial_samples"))

    def drain_freshest(self, n: int, max_staleness: int | None = None) -> list[StampedGroup] | None:
        """Evict groups over the staleness budget, then remove and return the ``n`` freshest.

        Returns ``None`` (consuming nothing) when fewer than ``n`` groups are buffered but jobs
        are in flight; raises ``RuntimeError`` when fewer than ``n`` are buffered and nothing is in
        flight. See :meth:`VersionedBuffer.drain_freshest`.
        """
        return self._buffer.drain_freshest(
            n,
            current_weight_version=self._weight_version,
            max_staleness=max_staleness,
            more_coming=len(self._pool) > 0,
        )

    def evict_stale(self, max_staleness: int) -> int:
        """Evict every buffered group with ``weight_version < weight_version_now - max_staleness``
        (handed out by ``pop_evicted``), as ``drain_freshest`` does first; returns how many.

        Lets a caller see how many trainable groups are buffered (``buffered``) before it asks for them.
        Raises ``ValueError`` if ``max_staleness < 0``.
        """
        require_at_least("max_staleness", max_staleness, 0)
        return self._buffer.evict_older_than(self._weight_version - max_staleness)

    def pop_evicted(self) -> list[StampedGroup]:
        """Return every group evicted as over-stale since the last call, once."""
        return self._buffer.pop_evicted()

    def _busy(self) -> str | None:
        if not self._pool:
            return None
        gen_ids = self._pool.gen_ids()
        return (
            f"{len(gen_ids)} generation(s) still in flight (gen_ids {gen_ids}); "
            f"call quiesce() first so that no rollout straddles two weight versions"
        )


def launch_ceiling(rollout_id: int, sync_interval: int, max_staleness: int, num_rollouts: int) -> int:
    """Exclusive upper bound on the ``gen_id`` that may be launched at training step ``rollout_id``.

    Generation ``g`` is trained at step ``g``; weights are synced after every ``sync_interval``
    steps, so the version at step ``r`` is ``r // sync_interval``. A rollout launched now carries
    version ``rollout_id // sync_interval`` and must be trained no more than ``max_staleness``
    versions later, hence::

        min(num_rollouts, (rollout_id // sync_interval + max_staleness + 1) * sync_interval)

    At ``max_staleness=0`` no launched rollout crosses the next sync boundary (with
    ``sync_interval=1`` this is ``rollout_id + 1``: synchronous training).

    Raises ``ValueError`` if ``rollout_id < 0``, ``sync_interval < 1``, ``max_staleness < 0`` or
    ``num_rollouts < 0``.
    """
    require_at_least("rollout_id", rollout_id, 0)
    require_at_least("sync_interval", sync_interval, 1)
    require_at_least("max_staleness", max_staleness, 0)
    require_at_least("num_rollouts", num_rollouts, 0)
    return min(num_rollouts, (rollout_id // sync_interval + max_staleness + 1) * sync_interval)


def admit_groups(
    *,
    trained_steps: int,
    sync_interval: int,
    max_staleness: int,
    groups_per_step: int,
    launched: int,
    inflight: int,
    max_inflight: int,
    num_groups: int | None = None,
) -> int:
    """How many more *groups* (one prompt's ``n`` samples each) may be launched now; never negative.

    The group-granular form of :func:`launch_ceiling`, and the same rule as AReaL's staleness
    manager (``min(max_concurrent - running, (max_staleness + version + 1) * batch - (accepted +
    running))``).

    Derivation. Number the groups that will be trained ``0, 1, 2, ...`` in launch order; group ``g``
    is trained at step ``g // groups_per_step``, under weight version
    ``(g // groups_per_step) // sync_interval``. A group launched now carries version
    ``v = trained_steps // sync_interval`` and may be trained up to version ``v + max_staleness``,
    so it may be launched only while ``g < (v + max_staleness + 1) * sync_interval *
    groups_per_step``: the ceiling ``launch_ceiling(trained_steps, sync_interval, max_staleness, .)``
    counted in groups. ``launched`` is every group launched so far that may still be trained (a
    group filtered out or dropped does not count: its slot is given back, so a replacement is
    simply the next admission). The window of groups in flight (``max_inflight``: what the engines
    can batch) caps it too, and ``num_groups`` (None: unbounded) caps the total.

    >>> admit_groups(trained_steps=0, sync_interval=1, max_staleness=1, groups_per_step=4,
    ...              launched=0, inflight=0, max_inflight=64)
    8
    >>> admit_groups(trained_steps=0, sync_interval=1, max_staleness=0, groups_per_step=4,
    ...              launched=4, inflight=4, max_inflight=64)
    0

    Raises ``ValueError`` for a negative count or a non-positive ``sync_interval``,
    ``groups_per_step`` or ``max_inflight``, naming the argument.
    """
    require_at_least("trained_steps", trained_steps, 0)
    require_at_least("sync_interval", sync_interval, 1)
    require_at_least("max_staleness", max_staleness, 0)
    require_at_least("groups_per_step", groups_per_step, 1)
    require_at_least("launched", launched, 0)
    require_at_least("inflight", inflight, 0)
    require_at_least("max_inflight", max_inflight, 1)
    ceiling = (trained_steps // sync_interval + max_staleness + 1) * sync_interval * groups_per_step
    if num_groups is not None:
        ceiling = min(ceiling, num_groups)
    return max(0, min(max_inflight - inflight, ceiling - launched))
