"""A cross-rank abort: one failing rank ends every rank of the run within ``abort_timeout_s``.

Without it, a rank whose step, reward or push raised leaves the others waiting in their next
collective until the process group's timeout (30 minutes by default), because a rank blocked inside
a collective cannot be told anything. :class:`CrossRankAbort` is a flag in a small key-value store of
its own (``torch.distributed.TCPStore``, hosted by rank 0, apart from the training process group), and
a daemon thread on every rank that polls it:

* the failing rank :meth:`~CrossRankAbort.signal`\\ s the flag with its error (``"rank 1:
  RuntimeError: ..."``) on its way out;
* every rank's thread also beats a counter of its own at every poll; a rank whose counter stands
  still for ``silence_s`` (killed, out of memory: it never signalled) counts as failed;
* every other rank's thread sees the flag within a poll (or finds the store gone: rank 0 has ended,
  or a silent rank) and calls its ``on_abort(message)``, which ends that rank (the strategy interrupts its main thread,
  gives it a moment to unwind, then stops its workers and exits with status 1).

A clean end :meth:`~CrossRankAbort.stop`\\ s the thread before the ranks' last barrier, so rank 0's store
closing is never taken for a failure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

__all__ = ["CrossRankAbort"]

log = logging.getLogger(__name__)

KEY = "unirl/abort"


class CrossRankAbort:
    """The abort flag of one rank (see the module docstring).

    Args:
        store: the store every rank of the run shares.
        rank / world_size: this rank and the number of ranks.
        on_abort: called once, from the polling thread, with the failing rank's message.
        poll_s: seconds between two looks at the flag (and two heartbeats).
        silence_s: a rank whose heartbeat stands still this long has failed.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        on_abort: Callable[[str], None],
        poll_s: float = 1.0,
        silence_s: float = 60.0,
    ) -> None:
        self.store, self.rank, self.world_size, self.on_abort = store, rank, world_size, on_abort
        self.poll_s, self.silence_s = poll_s, silence_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beats = 0
        self._heard: dict[int, tuple[str, float]] = {}  # rank -> (its last beat, when it changed)

    @classmethod
    def connect(
        cls,
        rank: int,
        world_size: int,
        broadcast: Callable[..., object],
        host: str,
        on_abort: Callable[[str], None],
        poll_s: float = 1.0,
        timeout_s: float = 60.0,
    ) -> CrossRankAbort:
        """Rank 0 hosts a store on a free port of ``host``; ``broadcast(obj, src=0)`` (the strategy's,
        a collective every rank calls at the same point) tells the others where, and they join it."""
        timeout = timedelta(seconds=timeout_s)
        store = None
        if rank == 0:
            store = dist.TCPStore(
                host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
            )
        port = int(broadcast(store.port if store is not None else None, src=0))
        if store is None:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        return cls(store, rank, world_size, on_abort, poll_s, silence_s=timeout_s)

    def start(self) -> CrossRankAbort:
        self._thread = threading.Thread(target=self._poll, name=f"unirl-abort-rank{self.rank}", daemon=True)
        self._thread.start()
        return self

    def signal(self, message: str) -> None:
        """Raise the flag with ``message`` (the first rank's message stands), and stop listening: this
        rank is the one ending the run."""
        self.stop()
        try:
            if not self.store.check([KEY]):
                self.store.set(KEY, message[:4000])
        except Exception as exc:  # noqa: BLE001 - the store's host may be gone already
            log.warning("rank %d could not raise the abort flag: %s", self.rank, exc)

    def stop(self) -> None:
        """Stop the polling thread (a clean end, or this rank signalled)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.poll_s + 1)

    def _silent_rank(self) -> str | None:
        """Beat this rank's counter; the message of a rank whose counter stood still ``silence_s``."""
        self._beats += 1
        self.store.set(f"{KEY}/beat/{self.rank}", str(self._beats))
        now = time.monotonic()
        for other in range(self.world_size):
            if other == self.rank:
                continue
            key = f"{KEY}/beat/{other}"
            beat = self.store.get(key).decode() if self.store.check([key]) else ""
            last, since = self._heard.get(other, (None, now))
            if beat != last:
                self._heard[other] = (beat, now)
            elif now - since > self.silence_s:
                return f"rank {other} stopped answering for {now - since:.0f} s (killed, or out of memory?)"
        return None

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                if self.store.check([KEY]):
                    message = self.store.get(KEY).decode(errors="replace")
                else:
                    message = self._silent_rank()
                    if message is None:
                        continue
            except Exception as exc:  # noqa: BLE001 - the store is rank 0's: it is gone
                if self._stop.is_set():
                    return
                message = f"rank 0 has ended (its abort store is unreachable: {type(exc).__name__})"
            if self._stop.is_set():
                return
            self._stop.set()
            self.on_abort(message)
            return
