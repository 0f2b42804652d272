"""Agentic rollout controller: a driver-side facade over a multi-turn rollout coordinator.

Who calls it
    The agentic training loop (policy: what to submit, when to drain, when to sync). Samples
    (trajectories) finish one at a time inside the coordinator, in any order; this controller
    assembles the ``group_size`` siblings of each prompt into one group, stamps it, buffers it and
    hands out the freshest groups with the same staleness rules as the batch controller (it reuses
    :class:`~unirl_lightning.rollout.controller.VersionedBuffer`).

The coordinator contract (the engine side implements it; tests use a small fake)
    ``coordinator.submit(requests: list) -> None``
        Start one background *drive* over ``requests`` and return without blocking. Each request
        produces one sample. The controller calls it only when no drive is live.
    ``coordinator.poll() -> list``
        Non-blocking: every sample that completed since the previous ``poll``/``abort``, each
        returned exactly once.
    ``coordinator.finalize_if_drained() -> bool``
        Atomically: if the drive has finished *and* every sample it produced has already been
        returned by ``poll``, join the drive and return True; otherwise change nothing and return
        False. (The atomicity is what makes "poll, then finalize, then submit" lossless: a sample
        completing between the poll and the finalize makes the finalize answer False.)
    ``coordinator.abort() -> list``
        Stop the drive at the next turn boundary and return the samples that finished during the
        abort. Samples that completed before the abort and were not yet polled stay available to
        one more ``poll``. After ``abort`` the drive is over.

    Every sample carries a string id (read with ``sample_id``, default ``sample.sample_id``) whose
    root (:func:`root_of`: the part before the first ``"/"``) names its group: the ``group_size``
    siblings of one prompt share a root, e.g. ``"prompt-7/0"`` ... ``"prompt-7/7"``.

What it guarantees
    * Completion-time stamps: a group is stamped with the weight version current when its *last*
      sibling is ingested, and with the next ``gen_id`` (consecutive from ``start_gen_id`` in
      completion order).
    * ``quiesce()`` = ``coordinator.abort()`` then one final ``coordinator.poll()``; the groups
      completed by either keep the pre-sync version (a sync cannot happen while a drive is live).
    * Tail policy, applied whenever a drive ends (``finalize_if_drained()`` returned True, or
      ``quiesce()``): groups with some but not all siblings arrived are the tail. ``"carry"`` keeps
      them for a later drive (which must deliver the missing siblings; ``tail_roots()`` lists them)
      and counts them in ``carried``; ``"drop"`` discards them, counts the groups in ``dropped`` and
      their samples in ``dropped_samples``, and discards any sibling of theirs that arrives later.
    * At most one drive is live: ``submit`` while a drive is live raises ``RuntimeError`` (two live
      drives would double-pull the coordinator's queue), and so does ``sync_weights``.
    * ``drain_freshest`` / ``pop_evicted`` behave exactly like the batch controller's, with "in
      flight" meaning "a drive is live".
    * Turn staleness: ``drain_freshest(..., max_turn_staleness=k)`` first evicts every buffered
      group whose *oldest* turn (the smallest of its samples' ``turn_versions``) is older than
      ``weight_version - k``, whatever its completion stamp; those come out once through
      ``pop_turn_evicted()``, not ``pop_evicted()``. The groups left keep their order.

What raises
    ``ValueError`` for bad arguments and malformed samples (empty or non-string ids, a sample id
    seen twice in one pending group); ``RuntimeError`` for ``submit``/``sync_weights`` while a
    drive is live and for a ``drain_freshest`` that can never be satisfied; whatever the
    coordinator or ``push`` raise, with the drive left live.

This module imports only the standard library: the training driver imports it without torch or ray.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Protocol

from unirl_lightning.core.checks import require_at_least
from unirl_lightning.rollout.controller import StampedGroup, VersionedBuffer
from unirl_lightning.rollout.pool import VersionLedger

__all__ = ["AgenticCoordinator", "AgenticRolloutController", "SiblingAssembler", "TailPolicy", "root_of"]

logger = logging.getLogger(__name__)

TailPolicy = Literal["carry", "drop"]
_TAIL_POLICIES = ("carry", "drop")


class AgenticCoordinator(Protocol):
    """The engine-side coordinator contract; see the module docstring for the semantics."""

    def submit(self, requests: list[Any]) -> None: ...

    def poll(self) -> list[Any]: ...

    def finalize_if_drained(self) -> bool: ...

    def abort(self) -> list[Any]: ...


def root_of(sample_id: str) -> str:
    """The group a sample belongs to: the part of its id before the first ``"/"``.

    ``root_of("prompt-7/3") == "prompt-7"``; a slash-free id is its own root. Raises
    ``ValueError`` for a non-string id or an empty root.
    """
    if not isinstance(sample_id, str):
        raise ValueError(
            f"sample_id must be a str like 'prompt-7/3', got {type(sample_id).__name__} {sample_id!r}"
        )
    root = sample_id.split("/", 1)[0]
    if not root:
        raise ValueError(f"sample_id must start with a non-empty root before any '/', got {sample_id!r}")
    return root


class SiblingAssembler:
    """Assemble samples arriving one at a time into groups of ``group_size`` siblings sharing a root.

    A group is emitted (in the order its siblings arrived) as soon as its ``group_size``-th
    sibling arrives. ``add`` validates the whole batch before changing anything.

    Example::

        pending = SiblingAssembler(group_size=2, sample_id=lambda sample: sample["id"])
        pending.add([{"id": "p0/0"}])  # -> []
        pending.add([{"id": "p0/1"}])  # -> [[{"id": "p0/0"}, {"id": "p0/1"}]]
    """

    def __init__(
        self, group_size: int, sample_id: Callable[[Any], str] = operator.attrgetter("sample_id")
    ) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size!r}")
        self._group_size = group_size
        self._sample_id = sample_id
        self._by_root: dict[str, dict[str, Any]] = {}  # root -> {sample_id: sample}, arrival order

    def __len__(self) -> int:
        """Number of groups with some but not all siblings arrived."""
        return len(self._by_root)

    @property
    def group_size(self) -> int:
        return self._group_size

    def tail_roots(self) -> list[str]:
        """Roots of the incomplete groups, oldest first."""
        return list(self._by_root)

    def arrived(self, root: str) -> int:
        """How many siblings of ``root`` are waiting for the rest of their group."""
        return len(self._by_root.get(root, ()))

    def add(self, samples: Iterable[Any]) -> list[list[Any]]:
        """Add completed samples; returns the groups they completed, in completion order.

        Raises ``ValueError`` (adding nothing) if an id is malformed or a sample id is already
        waiting in its group or repeated within ``samples``.
        """
        keyed: list[tuple[str, str, Any]] = []
        seen_in_batch: set[str] = set()
        for sample in samples:
            sample_id = self._sample_id(sample)
            root = root_of(sample_id)
            if sample_id in seen_in_batch or sample_id in self._by_root.get(root, ()):
                raise ValueError(
                    f"sample_id {sample_id!r} arrived twice for group {root!r}; every sibling must "
                    f"have its own id and complete once"
                )
            seen_in_batch.add(sample_id)
            keyed.append((root, sample_id, sample))
        completed: list[list[Any]] = []
        for root, sample_id, sample in keyed:
            siblings = self._by_root.setdefault(root, {})
            siblings[sample_id] = sample
            if len(siblings) == self._group_size:
                completed.append(list(self._by_root.pop(root).values()))
        return completed

    def discard(self, roots: Iterable[str]) -> int:
        """Forget the incomplete groups of ``roots``; returns how many samples were discarded."""
        return sum(len(self._by_root.pop(root, ())) for root in set(roots))


class AgenticRolloutController(VersionLedger):
    """Drive an agentic coordinator; buffer complete sibling groups with completion-time stamps.

    Args:
        coordinator: the engine-side coordinator (contract in the module docstring).
        group_size: siblings per prompt (GRPO's ``n``); a group is buffered once all arrived.
        tail_policy: ``"carry"`` keeps incomplete groups across drive ends, ``"drop"`` discards them.
        sample_id: reads a sample's id (default: its ``sample_id`` attribute).
        start_gen_id: the ``gen_id`` stamped on the first completed group.
        start_weight_version: the weight version the generators hold now.
        turn_versions: reads the weight version of each of a sample's turns (default: its
            ``turn_versions`` attribute); read only for ``max_turn_staleness``.

    Example::

        controller = AgenticRolloutController(coordinator, group_size=8, tail_policy="carry")
        controller.submit(requests)
        while (batch := controller.drain_freshest(4, max_staleness=1)) is None:
            controller.poll()
            if controller.finalize_if_drained():  # drive over (everything polled): refill
                controller.submit(next_requests())
        controller.quiesce()
        controller.sync_weights(weight_sync.push)
    """

    _pushed_to = "the agentic coordinator"

    def __init__(
        self,
        coordinator: AgenticCoordinator,
        group_size: int,
        tail_policy: TailPolicy = "carry",
        sample_id: Callable[[Any], str] = operator.attrgetter("sample_id"),
        start_gen_id: int = 0,
        start_weight_version: int = 0,
        turn_versions: Callable[[Any], Sequence[int]] = operator.attrgetter("turn_versions"),
    ) -> None:
        if tail_policy not in _TAIL_POLICIES:
            raise ValueError(f"tail_policy must be one of {_TAIL_POLICIES}, got {tail_policy!r}")
        for name, value in (("start_gen_id", start_gen_id), ("start_weight_version", start_weight_version)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        self._coordinator = coordinator
        self._tail_policy: TailPolicy = tail_policy
        self._pending = SiblingAssembler(group_size, sample_id)
        self._sample_id = sample_id
        self._buffer = VersionedBuffer()
        self._turn_versions = turn_versions
        self._turn_evicted: list[StampedGroup] = []
        self._next_gen_id = start_gen_id
        self._weight_version = start_weight_version
        self._drive_live = False
        self._dropped_roots: set[str] = set()
        self._carried = 0
        self._dropped = 0
        self._dropped_samples = 0

    @property
    def next_gen_id(self) -> int:
        """The ``gen_id`` the next completed group will be stamped with."""
        return self._next_gen_id

    @property
    def drive_live(self) -> bool:
        """True from ``submit`` until ``finalize_if_drained()`` returns True or ``quiesce()`` returns."""
        return self._drive_live

    @property
    def buffered(self) -> int:
        """Number of complete groups waiting to be drained."""
        return len(self._buffer)

    @property
    def pending_groups(self) -> int:
        """Number of groups with some but not all siblings arrived."""
        return len(self._pending)

    @property
    def tail_policy(self) -> TailPolicy:
        return self._tail_policy

    @property
    def carried(self) -> int:
        """Incomplete groups kept at drive ends (a group carried over two drive ends counts twice)."""
        return self._carried

    @property
    def dropped(self) -> int:
        """Incomplete groups discarded at drive ends (``tail_policy="drop"``)."""
        return self._dropped

    @property
    def dropped_samples(self) -> int:
        """Completed samples discarded with dropped groups, including siblings that arrive after the drop."""
        return self._dropped_samples

    def tail_roots(self) -> list[str]:
        """Roots of the incomplete groups (under ``"carry"``, the ones a later drive must finish)."""
        return self._pending.tail_roots()

    def submit(self, requests: Iterable[Any]) -> None:
        """Start a drive over ``requests``; raises ``RuntimeError`` if a drive is still live.

        The drive counts as live from before the coordinator is called, so if
        ``coordinator.submit`` raises, call ``quiesce()`` before submitting again.
        """
        if self._drive_live:
            raise RuntimeError(
                "submit refused: the previous drive is still live; poll() until finalize_if_drained() "
                "returns True, or quiesce(), first (two live drives would double-pull the coordinator queue)"
            )
        requests = list(requests)
        if not requests:
            raise ValueError("requests must hold at least one request, got 0")
        self._drive_live = True
        self._coordinator.submit(requests)

    def poll(self) -> int:
        """Ingest the samples completed since the last poll; returns the number of groups buffered."""
        if not self._drive_live:
            return 0
        return self._ingest(self._coordinator.poll())

    def finalize_if_drained(self) -> bool:
        """End the drive if the coordinator finished it and everything was polled; True when no drive is live.

        Poll first: the coordinator answers False while any completed sample is still unpolled.
        On True the tail policy is applied.
        """
        if not self._drive_live:
            return True
        if not self._coordinator.finalize_if_drained():
            return False
        self._end_drive()
        return True

    def quiesce(self) -> int:
        """Abort the live drive, ingest what finished during the abort plus one final poll, end the drive.

        Returns the number of groups buffered. The groups keep the pre-sync version; call this
        before ``sync_weights``. No-op (returns 0) when no drive is live.
        """
        if not self._drive_live:
            return 0
        finished = list(self._coordinator.abort())
        finished.extend(self._coordinator.poll())
        inserted = self._ingest(finished)
        self._end_drive()
        return inserted

    def drain_freshest(
        self, n: int, max_staleness: int | None = None, max_turn_staleness: int | None = None
    ) -> list[StampedGroup] | None:
        """Same contract as :meth:`BatchRolloutController.drain_freshest`, with "in flight" = drive live.

        ``max_turn_staleness`` (None = off): before draining, every group buffered whose oldest turn
        is older than ``weight_version - max_turn_staleness`` is evicted (after the groups over
        ``max_staleness`` by their completion stamp, which stay in ``pop_evicted()``); those come
        out once through :meth:`pop_turn_evicted`. Raises ``ValueError`` if either bound is < 0.
        """
        if max_turn_staleness is not None:
            require_at_least("max_turn_staleness", max_turn_staleness, 0)
            if max_staleness is not None:  # over-stale completion stamps are counted as such first
                require_at_least("max_staleness", max_staleness, 0)
                self._buffer.evict_older_than(self._weight_version - max_staleness)
            self._evict_turn_stale(self._weight_version - max_turn_staleness)
        return self._buffer.drain_freshest(
            n,
            current_weight_version=self._weight_version,
            max_staleness=max_staleness,
            more_coming=self._drive_live,
        )

    def pop_evicted(self) -> list[StampedGroup]:
        """Return every group evicted as over-stale (by its completion stamp) since the last call, once."""
        return self._buffer.pop_evicted()

    def pop_turn_evicted(self) -> list[StampedGroup]:
        """Every group evicted for an over-stale turn (``max_turn_staleness``) since the last call, once."""
        evicted, self._turn_evicted = self._turn_evicted, []
        return evicted

    def oldest_turn_version(self, item: StampedGroup) -> int:
        """The weight version of the oldest turn of any sample of the group (its stamp if none has a turn)."""
        return min(
            (v for sample in item.group for v in self._turn_versions(sample)), default=item.weight_version
        )

    def _evict_turn_stale(self, min_turn_version: int) -> None:
        """Move the buffered groups with a turn older than ``min_turn_version`` to the turn-evicted list;
        the others go back in their order (freshest version first, insertion order within one)."""
        if not len(self._buffer):
            return
        for item in self._buffer.take_freshest(len(self._buffer)):
            if self.oldest_turn_version(item) < min_turn_version:
                self._turn_evicted.append(item)
            else:
                self._buffer.insert(item)

    def _busy(self) -> str | None:
        if not self._drive_live:
            return None
        return (
            "a drive is live; quiesce() (or poll until finalize_if_drained() returns True) first so that "
            "no trajectory straddles two weight versions"
        )

    def _ingest(self, samples: Iterable[Any]) -> int:
        samples = list(samples)
        late_siblings_of_dropped = 0
        if self._dropped_roots:
            kept = [
                sample for sample in samples if root_of(self._sample_id(sample)) not in self._dropped_roots
            ]
            late_siblings_of_dropped = len(samples) - len(kept)
            samples = kept
        groups = self._pending.add(samples)  # validates everything before changing anything
        self._dropped_samples += late_siblings_of_dropped
        for group in groups:
            self._buffer.insert(StampedGroup(self._next_gen_id, self._weight_version, group))
            self._next_gen_id += 1
        return len(groups)

    def _end_drive(self) -> None:
        self._drive_live = False
        tail = self._pending.tail_roots()
        if not tail:
            return
        if self._tail_policy == "carry":
            self._carried += len(tail)
            return
        self._dropped += len(tail)
        self._dropped_samples += self._pending.discard(tail)
        self._dropped_roots.update(tail)
        logger.info("dropped %d incomplete group(s) at the end of a drive", len(tail))
