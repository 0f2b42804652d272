"""Every seed of a run, from one rule (standard library only: the lowest layer).

Rollout seeds (requests, ranks, worker parts, engine samples and chunks, agentic episodes and their
turns, generation calls, evaluation episodes) are :func:`derive_seed` hashes of the path that leads
to them, so two distinct paths never share a seed except by a 64-bit hash coincidence, and the same
path gives the same seed in every process (BLAKE2b, no process-dependent hashing).

Data seeds keep their historical values, because they decide which prompts are held out and in
which order a pass visits them: :func:`held_out_seed`, :func:`episode_held_out_seed` and
:func:`pass_seed` are named here so that no caller writes the sums itself.
"""

from __future__ import annotations

import hashlib
import os

__all__ = [
    "SEED_BITS",
    "VAL_SEED_OFFSET",
    "call_seed",
    "derive_seed",
    "derive_seeds",
    "episode_held_out_seed",
    "episode_seed",
    "eval_episode_seed",
    "global_seed",
    "held_out_seed",
    "pass_seed",
    "rank_seed",
    "turn_seed",
]

SEED_BITS = 63
"""Derived seeds lie in ``[0, 2**63)``: a non-negative int64, which every engine takes as it is
(``torch.Generator.manual_seed``, vLLM's ``SamplingParams.seed``, SGLang's ``sampling_seed``)."""

VAL_SEED_OFFSET = 1_000_003
"""Held-out records of a built-in task are drawn with ``seed + VAL_SEED_OFFSET`` (a data seed:
its value fixes the held-out sets, so it never changes)."""

_EVAL = -1  # the path tag of evaluation episodes: no training episode path has a negative part


def derive_seed(*parts: int) -> int:
    """A seed that is a hash of ``parts`` (ints, any size, any sign), in ``[0, 2**SEED_BITS)``.

    Seeds are derived level by level: a request's from ``(seed, rank, gen_id)``, a worker's part of
    it from ``(request seed, part)``, an engine's per-sample or per-chunk seeds from ``(part seed,
    index)``. Two of ``k`` derived seeds coincide with probability about ``k**2 / 2**64``.

    >>> derive_seed(0, 1) == derive_seed(0, 1) != derive_seed(1, 0)
    True
    >>> 0 <= derive_seed(-5, 2**80) < 2**63
    True
    """
    payload = ",".join(str(int(part)) for part in parts).encode()
    digest = hashlib.blake2b(payload, digest_size=8, person=b"unirl-seed").digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def derive_seeds(seed: int | None, count: int) -> list[int | None]:
    """The per-sample seeds of ``count`` samples under ``seed``: ``derive_seed(seed, k)`` for sample
    ``k``, or ``None`` for each when ``seed`` is None (unseeded).

    >>> derive_seeds(None, 2)
    [None, None]
    >>> derive_seeds(7, 2) == [derive_seed(7, 0), derive_seed(7, 1)]
    True
    """
    return [None] * count if seed is None else [derive_seed(seed, k) for k in range(count)]


def global_seed(default: int = 0) -> int:
    """The seed of ``lightning.seed_everything`` (the CLI's ``seed_everything``), read where Lightning
    puts it for its worker processes (``PL_GLOBAL_SEED``), else ``default``. Defaults that follow it
    (the strategy's rollout seed, LoRA's initialisation) make ``--seed_everything 1`` another run.

    >>> import os
    >>> os.environ["PL_GLOBAL_SEED"] = "7"; global_seed()
    7
    >>> del os.environ["PL_GLOBAL_SEED"]; global_seed(3)
    3
    """
    value = os.environ.get("PL_GLOBAL_SEED")
    return int(value) if value not in (None, "") else default


def rank_seed(seed: int, rank: int) -> int:
    """The root of rank ``rank``'s agentic episode seeds under the run's ``seed`` (rank 0 keeps the
    run's seed, so a single-rank run is seeded by the seed it was given).

    >>> rank_seed(5, 0), rank_seed(5, 1) == derive_seed(5, 1)
    (5, True)
    """
    return seed if rank == 0 else derive_seed(seed, rank)


def episode_seed(seed: int, group: int, sibling: int) -> int:
    """The seed of training episode ``sibling`` of prompt group ``group`` under a rank's ``seed``."""
    return derive_seed(seed, group, sibling)


def eval_episode_seed(seed: int, index: int, sibling: int) -> int:
    """The seed of evaluation episode ``sibling`` of held-out record ``index``: another path than
    any training episode's, so evaluation never replays a training episode's draws."""
    return derive_seed(seed, _EVAL, index, sibling)


def turn_seed(episode: int, turn: int) -> int:
    """The sampling seed of model turn ``turn`` (0-based) of the episode seeded ``episode``; it does
    not depend on the drive that plays the episode.

    >>> turn_seed(7, 3) == derive_seed(7, 3)
    True
    """
    return derive_seed(episode, turn)


def call_seed(seeds: list[int]) -> int:
    """The seed of one generation call over rows with these turn seeds: the row's own seed for one
    row, otherwise the hash of them in order.

    >>> call_seed([5]), call_seed([5, 6]) != call_seed([6, 5])
    (5, True)
    """
    return seeds[0] if len(seeds) == 1 else derive_seed(*seeds)


def held_out_seed(seed: int) -> int:
    """The seed of a built-in task's held-out records (a data seed: its value is history).

    >>> held_out_seed(3)
    1000006
    """
    return seed + VAL_SEED_OFFSET


def episode_held_out_seed(seed: int) -> int:
    """The seed of a built-in environment's held-out episode records (a data seed: ``seed + 1``)."""
    return seed + 1


def pass_seed(seed: int, epoch: int) -> int:
    """The seed of pass ``epoch``'s shuffled order: ``DistributedSampler``'s rule, ``seed + epoch``
    (a data seed: its value fixes the pass orders)."""
    return seed + epoch
