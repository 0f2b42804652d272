"""The trainer side of the streaming simulation: a small loop that drives the REAL
``BatchRolloutController`` (one job per group) and ``admit_groups`` over :class:`World`'s engines.

Each pass: admit what ``admit_groups`` allows; when the trainer is free, ``poll`` and
``drain_freshest(groups_per_step, evict)`` (the controller evicts by launch stamp); train the batch
(recompute log-probs if asked, then update: ``tokens * s_per_token / speedup(gpus)``, plus a fixed
``step_overhead_s`` where the config has one); every
``sync_interval`` batches sync: ``quiesce(interrupt=True)`` (the engines keep their rows), push
(``World.pause``), ``sync_weights``, ``resume(evict)`` (a group whose oldest token would be over the
bound is dropped, ``pop_dropped``), or with ``quiesce`` drain every group in flight first. Colocated
sync is the same loop at ``max_staleness=0``: generation, recompute, update and push never overlap.
With ``staleness_fraction`` (verl's ``staleness_threshold``), launches stop at ``(versions + 1 +
fraction)`` versions' worth of groups on top of ``admit_groups``: verl's rollouter starts at most
``(1 + threshold)`` versions' worth of prompts past those its trainer had taken at the last sync.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from benchmarks.harness import common  # noqa: F401 - this checkout first on sys.path
from benchmarks.simulation.streaming import Group, World
from unirl_lightning.rollout.controller import BatchRolloutController, admit_groups


class GroupHandle:
    """``GenerationHandle`` of one group, with the interrupt API the controller's ``SuspendedJobs`` uses."""

    def __init__(self, world: World, group: Group) -> None:
        self.world, self.group = world, group

    def ready(self) -> bool:
        return self.group.remaining == 0

    def wait(self) -> None:
        self.world.run_until(self.group)

    def result(self) -> Group:
        self.wait()
        return self.group

    def interrupt(self) -> bool:
        """The engines pause as a whole (``World.pause``): nothing to stop here; True when finished."""
        return self.group.remaining == 0

    def resume(self) -> None:
        """The rows stayed on their engine: they go on under the new version by themselves."""

    def oldest_token_version(self) -> int | None:
        versions = [r.segments[0][0] for r in self.group.rows if r.segments and not r.cancelled]
        return min(versions) if versions else None

    def partial_samples(self) -> int:
        return sum(1 for r in self.group.rows if r.tokens and r.tokens < r.target)


def speedup(gpus: int, cfg: Any) -> float:
    """How much faster ``gpus`` GPUs train than one: Amdahl (serial fraction ``amdahl``) or ``gpus**eff``."""
    if cfg.amdahl > 0:
        return 1.0 / (cfg.amdahl + (1 - cfg.amdahl) / gpus)
    return gpus**cfg.train_efficiency


def run(cfg: Any) -> dict[str, Any]:
    """One simulated run; ``cfg`` holds the workload, engine, trainer and mode (see simulate_streaming)."""
    colocated = cfg.mode == "sync"
    engines = cfg.gen_gpus // cfg.tp
    if engines < 1:
        raise ValueError(f"{cfg.gen_gpus} generation GPUs make no engine of tp={cfg.tp}")
    world = World(cfg, engines)
    staleness = 0 if colocated else cfg.max_staleness
    evict = 0 if colocated else cfg.evict_staleness
    interval = 1 if colocated else cfg.sync_interval
    gps, total = cfg.groups_per_step, cfg.steps + cfg.warmup
    rate = speedup(cfg.train_gpus, cfg)
    recomputes = cfg.sync_recompute if colocated else cfg.async_recompute
    live: dict[int, Any] = {}  # gen_id -> group, launched and not yet trained or lost

    def launch(group: Any) -> GroupHandle:
        world.add(group)
        return GroupHandle(world, group)

    controller = BatchRolloutController(launch)
    n = Counter()  # in the measured window: groups trained, evicted, dropped; tokens trained, wasted
    lost = Counter()  # since the start: groups evicted, dropped
    phase = Counter()  # seconds: wait, recompute, update, push, quiesce
    stale: Counter = Counter()
    trained_ids: set[int] = set()
    trained, train_end, wait_from = 0, None, 0.0
    t0, base = 0.0, (0.0, 0.0, 0, 0.0)

    def admit() -> None:
        launched = controller.next_gen_id - lost["evicted"] - lost["dropped"]
        k = admit_groups(
            trained_steps=trained,
            sync_interval=interval,
            max_staleness=staleness,
            groups_per_step=gps,
            launched=launched,
            inflight=controller.inflight + controller.suspended,
            max_inflight=cfg.max_inflight,
        )
        fraction = getattr(cfg, "staleness_fraction", None)  # verl's staleness_threshold (a fraction)
        if fraction is not None and not colocated:
            k = min(k, int((trained // interval + 1 + fraction) * gps * interval) - launched)
        for _ in range(k):
            group = world.new_group(controller.next_gen_id)
            live[group.gen_id] = group
            controller.submit(group)

    def lose(gen_id: int, why: str) -> None:
        group = live.pop(gen_id)
        n[why] += 1
        lost[why] += 1
        n["wasted_tokens"] += world.cancel(group) if group.remaining else sum(r.tokens for r in group.rows)

    def sync() -> None:
        start = world.now
        controller.quiesce(interrupt=not (colocated or cfg.quiesce))
        phase["quiesce"] += world.now - start
        controller.sync_weights(lambda version: world.pause(cfg.push_s, version))
        phase["push"] += cfg.push_s
        controller.resume(evict)
        for gen_id, _ in controller.pop_dropped():
            lose(gen_id, "dropped")

    while trained < total:
        admit()
        if train_end is None:
            controller.poll()
            batch = controller.drain_freshest(gps, evict)
            for item in controller.pop_evicted():
                lose(item.gen_id, "evicted")
            if batch is None:
                world.advance()
                continue
            phase["wait"] += world.now - wait_from
            tokens = 0
            for item in batch:
                group = live.pop(item.gen_id)
                assert item.gen_id not in trained_ids, f"group {item.gen_id} trained twice"
                trained_ids.add(item.gen_id)
                tokens += group.tokens()
                for row in group.rows:
                    for version, count in row.segments:
                        stale[controller.weight_version - version] += count
            recompute = tokens * cfg.recompute_s_per_token / rate if recomputes else 0.0
            update = tokens * cfg.update_s_per_token / rate
            phase["recompute"] += recompute
            phase["update"] += update
            n["trained"] += len(batch)
            n["trained_tokens"] += tokens
            train_end = world.now + recompute + update + getattr(cfg, "step_overhead_s", 0.0)
            continue
        world.advance(train_end)
        if world.now >= train_end:
            trained += 1
            train_end = None
            if trained % interval == 0:
                sync()
            wait_from = world.now
            if trained == cfg.warmup:  # the measured window starts here
                t0, base = world.now, world.counters()
                n, phase, stale = Counter(), Counter(), Counter()
    elapsed = world.now - t0
    rows, busy, steps_run, starved = world.counters()
    tokens_total = sum(stale.values()) or 1
    steps = cfg.steps
    inflight_now = controller.inflight + controller.suspended
    accounted = len(trained_ids) + lost["evicted"] + lost["dropped"] + inflight_now + controller.buffered
    assert accounted == controller.next_gen_id, (
        f"{controller.next_gen_id} groups launched, {accounted} accounted for"
    )
    return {
        "s_per_batch": elapsed / steps,
        "groups_per_s": n["trained"] / elapsed,
        "trained_tokens_per_s": n["trained_tokens"] / elapsed,
        "phases_s_per_batch": {
            k: phase[k] / steps for k in ("wait", "recompute", "update", "push", "quiesce")
        },
        "occupancy": (rows - base[0]) / (cfg.max_rows * engines * elapsed),
        # as the continuous HF engine counts them: the share of the time stepping, and a step's mean
        "engine_busy": (busy - base[1]) / (engines * elapsed),
        "engine_step_ms": 1e3 * (busy - base[1]) / max(1, steps_run - base[2]),
        "engine_starved": (starved - base[3]) / (cfg.max_rows * engines * elapsed),
        "token_staleness": {str(k): v / tokens_total for k, v in sorted(stale.items())},
        "groups": {
            "submitted": controller.next_gen_id,
            "trained": len(trained_ids),
            "evicted": lost["evicted"],
            "dropped": lost["dropped"],
            "in_flight": inflight_now,
            "buffered": controller.buffered,
        },
        "lost_groups_in_window": n["evicted"] + n["dropped"],
        "wasted_token_share": n["wasted_tokens"] / max(1, n["trained_tokens"] + n["wasted_tokens"]),
        "engines": engines,
    }
