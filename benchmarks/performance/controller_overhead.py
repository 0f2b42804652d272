"""Driver-side overhead of ``BatchRolloutController``: microseconds of controller time per group.

Drives the loop shape of training with generation made free (always-ready pendings), so that all
that is left is the controller's own bookkeeping::

    every step: launch_until(max_inflight=2) -> poll -> drain_freshest(groups_per_job, max_staleness=1)
    every ``sync_every`` drains: quiesce -> sync_weights

Two jobs are launched per step and one job's worth of groups is drained, so the buffer holds
several weight versions and every sync makes a version over-stale: insert, freshest-first drain
across versions and eviction are all exercised.

Only the controller calls are timed (``time.perf_counter`` around each). Prints a table (phase,
total seconds, microseconds per group) and, as the last line, a JSON record that is also written to
``benchmarks/results/controller_overhead.json``. Target: <= 20 us/group over 100k groups.

Usage::

    python -m benchmarks.performance.controller_overhead [--groups 100000] [--sync-every 4] [--groups-per-job 8]
"""

from __future__ import annotations

import platform
import time
from typing import Any

from benchmarks.harness import common
from unirl_lightning.rollout.controller import BatchRolloutController

TARGET_US_PER_GROUP = 20.0
MAX_STALENESS = 1
LAUNCHES_PER_STEP = 2  # max_inflight: always-ready jobs are reaped by the same step's poll


class ReadyPending:
    """A generation that has already finished: the cheapest possible ``GenerationHandle``."""

    __slots__ = ("_groups",)

    def __init__(self, groups: list[int]) -> None:
        self._groups = groups

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def result(self) -> list[int]:
        return self._groups


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Push ``config["groups"]`` groups through the controller; the record (phase seconds, us/group)."""
    groups, sync_every, groups_per_job = config["groups"], config["sync_every"], config["groups_per_job"]
    num_jobs = -(-groups // groups_per_job)
    job_groups = list(range(groups_per_job))
    controller = BatchRolloutController(ReadyPending, complete=lambda gen_id, weight_version, result: result)

    def build(gen_id: int) -> list[int]:
        return job_groups

    def push(new_version: int) -> None:
        pass

    phase_seconds = {"launch": 0.0, "poll": 0.0, "drain": 0.0, "sync": 0.0}
    clock = time.perf_counter
    drained_groups = 0
    evicted = 0
    max_staleness_seen = 0
    drains = 0
    while controller.next_gen_id < num_jobs:
        started = clock()
        controller.launch_until(num_jobs, LAUNCHES_PER_STEP, build)
        launched = clock()
        controller.poll()
        polled = clock()
        batch = controller.drain_freshest(groups_per_job, max_staleness=MAX_STALENESS)
        evicted += len(controller.pop_evicted())
        drained = clock()
        phase_seconds["launch"] += launched - started
        phase_seconds["poll"] += polled - launched
        phase_seconds["drain"] += drained - polled
        if batch is None:
            raise RuntimeError(
                f"drain {drains}: only {controller.buffered} groups buffered with work in flight"
            )
        drains += 1
        drained_groups += len(batch)
        max_staleness_seen = max(
            max_staleness_seen, controller.weight_version - min(item.weight_version for item in batch)
        )
        if drains % sync_every == 0:
            started = clock()
            controller.quiesce()
            controller.sync_weights(push)
            phase_seconds["sync"] += clock() - started

    inserted = drained_groups + evicted + controller.buffered
    if inserted != num_jobs * groups_per_job:
        raise RuntimeError(f"lost groups: {inserted} accounted for, {num_jobs * groups_per_job} generated")
    total_seconds = sum(phase_seconds.values())
    return {
        "us_per_group": total_seconds / inserted * 1e6,
        "groups": inserted,
        "drained": drained_groups,
        "evicted": evicted,
        "left_buffered": controller.buffered,
        "jobs": num_jobs,
        "groups_per_job": groups_per_job,
        "sync_every": sync_every,
        "max_staleness": MAX_STALENESS,
        "max_staleness_seen": max_staleness_seen,
        "launches_per_step": LAUNCHES_PER_STEP,
        "weight_syncs": controller.weight_version,
        "total_s": total_seconds,
        "phase_s": phase_seconds,
        "target_us_per_group": TARGET_US_PER_GROUP,
        "meets_target": total_seconds / inserted * 1e6 <= TARGET_US_PER_GROUP,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--groups", type=int, default=100_000, help="groups to push through (default 100000)")
    parser.add_argument("--sync-every", type=int, default=4, help="steps between weight syncs (default 4)")
    parser.add_argument("--groups-per-job", type=int, default=8, help="groups per generation (default 8)")
    config = common.parse_config(parser)
    for name in ("groups", "sync_every", "groups_per_job"):
        if config[name] < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {config[name]}")

    record = run(config)

    print(f"{'phase':<8} {'total s':>10} {'us/group':>10}")
    for phase, seconds in record["phase_s"].items():
        print(f"{phase:<8} {seconds:>10.4f} {seconds / record['groups'] * 1e6:>10.3f}")
    print(f"{'total':<8} {record['total_s']:>10.4f} {record['us_per_group']:>10.3f}")
    common.finish(record, "controller_overhead", config=config)


if __name__ == "__main__":
    main()
