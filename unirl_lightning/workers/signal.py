"""The interrupt signal of ``sync_mode="interrupt"``: how a sync reaches a request in flight.

A rollout worker is a Ray actor with ``max_concurrency=1``, so a call asking it to stop would queue
behind the ``generate`` it should stop. Instead every chunk request carries this signal and the
epoch it was launched in; the worker reads the signal between chunks
(:func:`~unirl_lightning.engines.base.generate_chunks`) and returns its partial samples once the
driver has bumped the epoch. The epoch lives in a tiny Ray actor of its own (no CPU reserved), so
reading it never waits for a worker.

Contract: :meth:`InterruptSignal.bump` (driver) returns once the new epoch is readable by every
worker; :meth:`InterruptSignal.fired` (worker) is True when the epoch is past ``epoch``;
:attr:`InterruptSignal.epoch` is the driver's current epoch (requests launched now carry it).
"""

from __future__ import annotations

from typing import Any

import ray

__all__ = ["InterruptSignal"]


class _Epoch:
    def __init__(self) -> None:
        self.value = 0

    def set(self, value: int) -> int:
        self.value = max(self.value, value)
        return self.value

    def get(self) -> int:
        return self.value


class InterruptSignal:
    """The driver bumps it at a sync; chunk requests launched before the bump stop at a chunk boundary.

    Args:
        actor: the Ray actor holding the epoch (``InterruptSignal.create()`` starts one).
    """

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.epoch = 0

    @classmethod
    def create(cls) -> InterruptSignal:
        """A signal with a fresh epoch actor (no CPU reserved: it only answers integer reads)."""
        return cls(ray.remote(num_cpus=0)(_Epoch).remote())

    def bump(self) -> None:
        """Interrupt every request launched so far (returns once the workers can read it)."""
        self.epoch += 1
        ray.get(self.actor.set.remote(self.epoch), timeout=60)

    def fired(self, epoch: int) -> bool:
        """Whether a request launched at ``epoch`` has been interrupted since (a worker calls it)."""
        return ray.get(self.actor.get.remote(), timeout=60) > epoch

    def close(self) -> None:
        """Kill the epoch actor."""
        ray.kill(self.actor)
