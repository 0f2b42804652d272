"""The cross-rank abort flag: a rank's signal reaches the others within a poll, a rank that goes
silent counts as failed, a store that disappears ends the listeners, and a clean stop never aborts."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from unirl_lightning.distributed.abort import CrossRankAbort


def two_ranks(silence_s: float = 30.0):
    master = dist.TCPStore(
        "127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False
    )
    other = dist.TCPStore("127.0.0.1", master.port, 2, is_master=False, timeout=timedelta(seconds=10))
    heard: dict[int, str] = {}
    events = {0: threading.Event(), 1: threading.Event()}

    def listener(rank):
        def on_abort(message):
            heard[rank] = message
            events[rank].set()

        return on_abort

    ranks = [
        CrossRankAbort(store, rank, 2, listener(rank), poll_s=0.05, silence_s=silence_s)
        for rank, store in enumerate((master, other))
    ]
    return master, ranks, heard, events


def test_a_signal_reaches_the_other_rank_with_the_first_message():
    _, (rank0, rank1), heard, events = two_ranks()
    rank0.start(), rank1.start()
    rank1.signal("rank 1: RuntimeError: boom")
    assert events[0].wait(5)
    assert heard == {0: "rank 1: RuntimeError: boom"}  # the signalling rank does not abort itself
    rank0.signal("rank 0: KeyboardInterrupt: ")  # the aborting rank's own exception, later
    assert rank0.store.get("unirl/abort") == b"rank 1: RuntimeError: boom"  # the first message stands


def test_a_silent_rank_counts_as_failed_after_silence_s():
    _, (rank0, _rank1), heard, events = two_ranks(silence_s=0.5)
    start = time.monotonic()
    rank0.start()  # rank 1 never beats (killed before it could)
    assert events[0].wait(5)
    assert 0.5 <= time.monotonic() - start < 5
    assert heard[0].startswith("rank 1 stopped answering")


def test_a_clean_stop_never_aborts_even_when_the_store_goes():
    master, (rank0, rank1), heard, events = two_ranks()
    rank0.start(), rank1.start()
    time.sleep(0.2)
    rank1.stop(), rank0.stop()
    del master
    time.sleep(0.3)
    assert heard == {}
