"""The controllers' parts: the in-flight pool (launched jobs, reaped complete-or-nothing), the versioned
buffer (stamped groups awaiting training, evicted by version) and the version ledger (the sync's idle
check and version bump, shared by the batch and the agentic controller). Mechanism only, standard
library only; :class:`~unirl_lightning.rollout.controller.BatchRolloutController` composes them and
documents the guarantees."""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from unirl_lightning.core.checks import require_at_least

__all__ = ["Complete", "GenerationHandle", "InflightPool", "StampedGroup", "VersionLedger", "VersionedBuffer"]

logger = logging.getLogger(__name__)


class GenerationHandle(Protocol):
    """A non-blocking handle on one launched generation (e.g. a Ray ``GenerationCall`` of the worker group)."""

    def ready(self) -> bool:
        """True once ``result()`` would return (or raise) without blocking."""
        ...

    def wait(self) -> None:
        """Block until the generation has finished (successfully or not)."""
        ...

    def result(self) -> Any:
        """The generation's output; may raise, and may be called again after raising."""
        ...


@dataclass(frozen=True, slots=True)
class StampedGroup:
    """One group of samples with the generation it came from and the weight version it was made under.

    ``group`` is whatever the controller's ``complete`` callback produced (e.g. the ``n`` samples
    of one prompt); the controller never looks inside it.
    """

    gen_id: int
    weight_version: int
    group: Any


@dataclass(slots=True)
class _InflightJob:
    gen_id: int
    weight_version: int
    pending: GenerationHandle


class VersionedBuffer:
    """Stamped groups awaiting training, kept grouped by weight version.

    Mechanism only: the caller says which version is current and how stale is too stale.
    Insertion is O(1) (amortised; O(log V) when a new version appears, V = distinct versions
    buffered), eviction of a whole version is O(groups evicted), and draining ``n`` groups is
    O(n + V).

    Example::

        buffer = VersionedBuffer()
        buffer.insert(StampedGroup(gen_id=0, weight_version=0, group="a"))
        buffer.insert(StampedGroup(gen_id=1, weight_version=1, group="b"))
        buffer.drain_freshest(1, current_weight_version=1, max_staleness=0, more_coming=False)
        # -> [StampedGroup(gen_id=1, weight_version=1, group='b')]; "a" is now in pop_evicted()
    """

    def __init__(self) -> None:
        self._by_version: dict[int, deque[StampedGroup]] = {}
        self._versions: list[int] = []  # sorted ascending; exactly the keys of _by_version
        self._size = 0
        self._evicted: list[StampedGroup] = []

    def __len__(self) -> int:
        return self._size

    def insert(self, item: StampedGroup) -> None:
        """Buffer one stamped group (after every group already buffered at the same version)."""
        bucket = self._by_version.get(item.weight_version)
        if bucket is None:
            bucket = self._by_version[item.weight_version] = deque()
            bisect.insort(self._versions, item.weight_version)
        bucket.append(item)
        self._size += 1

    def evict_older_than(self, min_weight_version: int) -> int:
        """Move every group with ``weight_version < min_weight_version`` to the evicted list.

        Returns how many groups were evicted. Evicted groups are handed out once by
        :meth:`pop_evicted`, oldest version first.
        """
        evicted = 0
        versions = self._versions
        while versions and versions[0] < min_weight_version:
            bucket = self._by_version.pop(versions.pop(0))
            self._evicted.extend(bucket)
            evicted += len(bucket)
        self._size -= evicted
        return evicted

    def take_freshest(self, n: int) -> list[StampedGroup] | None:
        """Remove and return the ``n`` freshest groups, or return ``None`` and remove nothing if fewer.

        Freshest means highest ``weight_version`` first; within one version, insertion order.
        """
        require_at_least("n", n, 1)
        if self._size < n:
            return None
        taken: list[StampedGroup] = []
        versions = self._versions
        while len(taken) < n:
            bucket = self._by_version[versions[-1]]
            still_needed = n - len(taken)
            if len(bucket) <= still_needed:
                taken.extend(bucket)
                del self._by_version[versions.pop()]
            else:
                popleft = bucket.popleft
                taken.extend([popleft() for _ in range(still_needed)])
        self._size -= n
        return taken

    def drain_freshest(
        self,
        n: int,
        *,
        current_weight_version: int,
        max_staleness: int | None,
        more_coming: bool,
    ) -> list[StampedGroup] | None:
        """Evict what is over the staleness budget, then take the ``n`` freshest groups.

        Both controllers' ``drain_freshest`` are this method:

        1. If ``max_staleness`` is not None, every group with
           ``weight_version < current_weight_version - max_staleness`` is evicted.
        2. If fewer than ``n`` groups remain: raise ``RuntimeError`` when ``more_coming`` is
           False (nothing in flight, so the request can never be satisfied); otherwise return
           ``None`` having consumed nothing.
        3. Otherwise remove and return the ``n`` freshest (see :meth:`take_freshest`).

        Raises ``ValueError`` if ``n < 1`` or ``max_staleness < 0``.
        """
        require_at_least("n", n, 1)
        if max_staleness is not None:
            require_at_least("max_staleness", max_staleness, 0)
            self.evict_older_than(current_weight_version - max_staleness)
        if self._size < n:
            if not more_coming:
                raise RuntimeError(
                    f"drain_freshest(n={n}) can never be satisfied: only {self._size} group(s) are "
                    f"buffered and nothing is in flight to produce more; launch more work or ask for fewer"
                )
            return None
        return self.take_freshest(n)

    def pop_evicted(self) -> list[StampedGroup]:
        """Return every group evicted since the last call (oldest version first), then forget them."""
        evicted, self._evicted = self._evicted, []
        return evicted


Complete = Callable[[int, int, Any], Iterable[Any]]
"""``complete(gen_id, weight_version, result) -> groups``: turn one generation's result into groups."""


class InflightPool:
    """Launched jobs keyed by ``gen_id``, reaped complete-or-nothing.

    Mechanism only: the pool does not launch anything, number anything or decide when to reap.
    Jobs are kept in insertion order, which the controller makes ``gen_id`` order.
    """

    def __init__(self) -> None:
        self._jobs: dict[int, _InflightJob] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def gen_ids(self) -> list[int]:
        """The ``gen_id`` of every job in flight, oldest first."""
        return list(self._jobs)

    def add(self, gen_id: int, weight_version: int, pending: GenerationHandle) -> None:
        """Track one launched job; raises ``ValueError`` if ``gen_id`` is already in flight."""
        if gen_id in self._jobs:
            raise ValueError(
                f"gen_id {gen_id} is already in flight; every in-flight job needs its own gen_id"
            )
        self._jobs[gen_id] = _InflightJob(gen_id, weight_version, pending)

    def jobs(self) -> list[tuple[int, int, GenerationHandle]]:
        """``(gen_id, launch stamp, handle)`` of every job in flight, oldest first."""
        return [(job.gen_id, job.weight_version, job.pending) for job in self._jobs.values()]

    def remove(self, gen_id: int) -> None:
        """Stop tracking ``gen_id`` (an interrupt suspends it); ``KeyError`` if it is not in flight."""
        del self._jobs[gen_id]

    def oldest(self) -> GenerationHandle | None:
        """The pending handle of the oldest job in flight, or ``None`` when nothing is in flight."""
        for job in self._jobs.values():
            return job.pending
        return None

    def reap_ready(self, complete: Complete, insert: Callable[[StampedGroup], None]) -> int:
        """Reap every job whose ``pending.ready()`` is true; returns the number of groups inserted.

        See :meth:`_reap` for the per-job contract and the error contract.
        """
        ready = [job for job in self._jobs.values() if job.pending.ready()]
        return self._reap(ready, complete, insert, wait_first=False)

    def reap_all(self, complete: Complete, insert: Callable[[StampedGroup], None]) -> int:
        """Wait for and reap every job in flight, in ``gen_id`` order; returns groups inserted.

        Same error contract as :meth:`reap_ready`: a job whose reap fails stays in flight, so the
        pool may be non-empty when this raises.
        """
        return self._reap(list(self._jobs.values()), complete, insert, wait_first=True)

    def _reap(
        self,
        jobs: list[_InflightJob],
        complete: Complete,
        insert: Callable[[StampedGroup], None],
        *,
        wait_first: bool,
    ) -> int:
        """Reap ``jobs`` in order, each complete-or-nothing.

        Per job: ``groups = list(complete(gen_id, weight_version, pending.result()))``; only when
        that returned is the job removed and each group inserted as a :class:`StampedGroup`.
        An ``Exception`` leaves the job in flight; the sweep continues, and the first such error
        is re-raised at the end (later ones are logged). Any other ``BaseException`` (e.g.
        ``KeyboardInterrupt``) propagates at once, with the job being reaped still in flight and
        the jobs already reaped in this sweep already inserted.
        """
        first_error: Exception | None = None
        inserted = 0
        for job in jobs:
            try:
                if wait_first:
                    job.pending.wait()
                groups = list(complete(job.gen_id, job.weight_version, job.pending.result()))
            except Exception as error:
                if first_error is None:
                    first_error = error
                else:
                    logger.error(
                        "reap of gen_id=%d failed too (the first failure will be raised); it stays in flight",
                        job.gen_id,
                        exc_info=error,
                    )
                continue
            del self._jobs[job.gen_id]
            gen_id, weight_version = job.gen_id, job.weight_version
            for group in groups:
                insert(StampedGroup(gen_id, weight_version, group))
            inserted += len(groups)
        if first_error is not None:
            raise first_error
        return inserted


class VersionLedger:
    """The weight version the generators hold, and the sync's two steps on it: :meth:`require_idle`
    (nothing may straddle two versions) and :meth:`advance_version` (after a push returned). A
    controller sets ``_weight_version`` and implements :meth:`_busy`."""

    _weight_version: int
    _pushed_to = "the generators"  # named in the log line of each push

    @property
    def weight_version(self) -> int:
        """The version of the weights the generators hold (bumped only by :meth:`advance_version`)."""
        return self._weight_version

    def _busy(self) -> str | None:  # pragma: no cover - abstract
        """Why a push must wait now (the rest of the refusal's message), or None when idle."""
        raise NotImplementedError

    def require_idle(self, in_place: bool = False) -> None:
        """Raise ``RuntimeError`` while work is in flight: a generation must never straddle two weight
        versions (quiesce first). The check before every push.

        ``in_place=True`` (``sync_mode="continue"``) is the one exception, for engines that load
        between two decode steps and stamp every token with the version that sampled it: the jobs in
        flight go on through the push under their launch stamps. Every token is at least as new as its
        job's stamp, so evicting by stamp still bounds the staleness of the oldest token."""
        why = None if in_place else self._busy()
        if why is not None:
            raise RuntimeError(f"sync_weights refused: {why}")

    def advance_version(self, in_place: bool = False) -> int:
        """Record that the generators now hold the next weights; returns the new version. Call it after
        the push succeeded (a push that raised leaves the version where it was)."""
        self.require_idle(in_place)
        self._weight_version += 1
        logger.info("pushed weights to %s: weight_version=%d", self._pushed_to, self._weight_version)
        return self._weight_version

    def sync_weights(self, push: Callable[[int], Any]) -> int:
        """:meth:`require_idle`, ``push(new_version)``, :meth:`advance_version`: the sync for a
        controller used on its own (the runtime spells the three steps out)."""
        self.require_idle()
        push(self._weight_version + 1)
        return self.advance_version()
