"""Randomised property test of interruptible generation (``sync_mode="interrupt"``).

The real :class:`BatchRolloutController` with :class:`ChunkedGeneration` jobs over a simulated engine
(each sample has a target length; a chunk generates at most ``chunk_tokens`` tokens of each row it is
sent; token ids and log-probs encode the sample, the position and the weight version, so a test can
read back which version generated each token). Each seed draws one schedule of operations: launch,
finish a chunk, arm a one-shot chunk failure, poll, drain, and sync (quiesce with interrupt -> push
-> resume, in the runtime's order, sometimes a plain quiesce). After every operation and at the end:

1. no token is trained beyond the bound: at drain, ``current - oldest token version <= max_staleness``;
2. no sample is trained twice, and every sample of every launch is exactly one of trained, evicted
   (its group counted), dropped at resume (its job counted), or still buffered / in flight / suspended;
3. behaviour log-probs are aligned with their tokens: token ``i`` of a trained sample has the log-prob
   and the version the engine produced for position ``i``;
4. the version advances exactly once per sync, and never while anything is in flight.

Violations are counted, not raised at the first one, and the summary (seeds, schedules, operations,
interrupts, violations) is printed; the test asserts 0 violations.
"""

from __future__ import annotations

import json
import random
from typing import Any

from unirl_lightning.rollout.controller import BatchRolloutController
from unirl_lightning.rollout.interrupts import ChunkedGeneration
from unirl_lightning.rollout.loop import token_version_stats
from unirl_lightning.rollout.records import GenerationResult, Rollout, RolloutRequest, SamplingParams

SEEDS = range(300)
OPERATIONS = 160
MAX_NEW_TOKENS = 12


class InjectedFailure(Exception):
    """A chunk failure the test injected (the chunk's handle retries it)."""


def token_id(gen_id: int, record: int, sample: int, position: int) -> int:
    return ((gen_id * 64 + record) * 8 + sample) * 32 + position


def logprob(position: int, version: int) -> float:
    return -(position + 1) - 1000.0 * version


class Chunk:
    """A pending chunk of the simulated engine: ready once the schedule says so (or waited on)."""

    def __init__(self, engine: SimEngine, request: RolloutRequest) -> None:
        self.engine, self.request = engine, request
        self.launch_version = engine.version
        self.is_ready = False
        self.failures_left = 0

    def ready(self) -> bool:
        return self.is_ready

    def wait(self) -> None:
        self.is_ready = True

    def result(self) -> dict[str, Any]:
        if self.failures_left:
            self.failures_left -= 1
            raise InjectedFailure("chunk")
        if self.engine.version != self.launch_version:  # a push while this chunk was in flight
            self.engine.violations.append(
                f"gen_id {self.request.gen_id}: chunk launched at v{self.launch_version}, "
                f"finished at v{self.engine.version}"
            )
        return self.engine.generate(self.request)


class SimEngine:
    """Each sample ``(gen_id, record, sample)`` stops after a target length drawn from the seed (long
    tail: most short, a few at ``MAX_NEW_TOKENS``)."""

    def __init__(self, rng: random.Random, version: int) -> None:
        self.rng, self.version = rng, version
        self.targets: dict[tuple[int, int, int], int] = {}
        self.chunks: list[Chunk] = []
        self.violations: list[str] = []

    def target(self, key: tuple[int, int, int]) -> int:
        if key not in self.targets:
            long = self.rng.random() < 0.2
            self.targets[key] = MAX_NEW_TOKENS if long else self.rng.randint(1, 4)
        return self.targets[key]

    def launch(self, request: RolloutRequest) -> Chunk:
        chunk = Chunk(self, request)
        self.chunks.append(chunk)
        return chunk

    def generate(self, request: RolloutRequest) -> dict[str, Any]:
        assert request.partial is not None and request.chunk_tokens is not None
        groups = []
        for record, rows in zip(request.records, request.partial):
            group = []
            for row in rows:
                key = (request.gen_id, record["index"], row.sample)
                start, target = len(row.completion_ids), self.target(key)
                end = min(target, start + request.chunk_tokens)
                ids = [token_id(*key, p) for p in range(start, end)]
                finish = (
                    "stop" if end == target < MAX_NEW_TOKENS else "length" if end == target else "aborted"
                )
                group.append(
                    Rollout(
                        prompt_ids=[0],
                        completion_ids=list(row.completion_ids) + ids,
                        logprobs=list(row.logprobs) + [logprob(p, self.version) for p in range(start, end)],
                        token_versions=list(row.token_versions) + [self.version] * len(ids),
                        reward=float(record["index"] % 2),
                        finish_reason=finish,
                        group_id=record["index"],
                        gen_id=request.gen_id,
                        weight_version=self.version,
                    )
                )
            groups.append(group)
        return GenerationResult(groups)


def run_schedule(seed: int) -> dict[str, Any]:
    """One random schedule; returns its counts and the violations found."""
    rng = random.Random(seed)
    max_staleness = rng.randint(0, 3)
    start_version = rng.randint(0, 2)
    engine = SimEngine(rng, start_version)
    violations = engine.violations
    samples: dict[int, set[tuple[int, int, int]]] = {}  # gen_id -> its samples

    def complete(gen_id: int, weight_version: int, result: GenerationResult) -> list[Any]:
        return result.groups

    controller = BatchRolloutController(
        lambda request: ChunkedGeneration(engine.launch, request, rng.randint(1, 5)),
        complete=complete,
        start_weight_version=start_version,
    )
    trained: list[tuple[int, int, int]] = []
    evicted: set[tuple[int, int, int]] = set()
    dropped: set[int] = set()
    syncs = interrupts = 0

    def account_evicted() -> None:
        for item in controller.pop_evicted():
            evicted.update((item.gen_id, r.group_id, s) for s, r in enumerate(item.group))
        for gen_id, _ in controller.pop_dropped():
            dropped.add(gen_id)

    def check_drained(drained: list[Any]) -> None:
        now = controller.weight_version
        for item in drained:
            for sample, rollout in enumerate(item.group):
                key = (item.gen_id, rollout.group_id, sample)
                versions = rollout.versions()
                if now - min(versions) > max_staleness:
                    violations.append(f"seed {seed}: {key} trained {now - min(versions)} versions old")
                if min(versions) < item.weight_version:
                    violations.append(f"seed {seed}: {key} has a token older than its launch stamp")
                for position, (token, lp, version) in enumerate(
                    zip(rollout.completion_ids, rollout.logprobs, versions, strict=True)
                ):
                    if token != token_id(*key, position) or lp != logprob(position, version):
                        violations.append(f"seed {seed}: {key} token {position} misaligned")
                if rollout.finish_reason == "aborted":
                    violations.append(f"seed {seed}: {key} trained unfinished")
                trained.append(key)
        try:
            token_version_stats([item.group for item in drained], now, max_staleness)
        except RuntimeError as error:
            violations.append(f"seed {seed}: {error}")

    for _ in range(OPERATIONS):
        op = rng.choices(["launch", "finish", "fail", "poll", "drain", "sync"], [3, 8, 1, 3, 3, 2])[0]
        if op == "launch" and controller.inflight < 4:
            gen_id = controller.next_gen_id
            records = [{"prompt": "", "index": i} for i in range(rng.randint(1, 3))]
            n = rng.randint(1, 3)
            samples[gen_id] = {(gen_id, i, s) for i in range(len(records)) for s in range(n)}
            controller.submit(
                RolloutRequest(records, n, SamplingParams(max_new_tokens=MAX_NEW_TOKENS), gen_id=gen_id)
            )
        elif op == "finish" and engine.chunks:
            rng.choice(engine.chunks).is_ready = True
        elif op == "fail" and engine.chunks:
            rng.choice(engine.chunks).failures_left = 1
        elif op == "poll":
            try:
                controller.poll()
            except InjectedFailure:
                pass
        elif op == "drain":
            try:
                drained = controller.drain_freshest(rng.randint(1, 3), max_staleness)
            except RuntimeError:
                drained = None  # nothing in flight and too few buffered
            account_evicted()
            if drained:
                check_drained(drained)
        elif op == "sync":
            before = controller.weight_version
            interrupt = rng.random() < 0.8
            try:
                controller.quiesce(interrupt=interrupt)
            except InjectedFailure:
                try:
                    controller.sync_weights(lambda version: None)
                    violations.append(f"seed {seed}: sync_weights pushed with a failed job in flight")
                except RuntimeError:
                    pass
                continue
            interrupts += controller.suspended
            pushes: list[int] = []
            if controller.inflight:
                violations.append(f"seed {seed}: {controller.inflight} job(s) in flight after quiesce")

            def push(version: int, pushes: list[int] = pushes) -> None:
                pushes.append(version)
                engine.version = version

            controller.sync_weights(push)
            controller.resume(max_staleness)
            account_evicted()
            syncs += 1
            if controller.weight_version != before + 1 or pushes != [before + 1]:
                violations.append(
                    f"seed {seed}: sync moved v{before} -> v{controller.weight_version}, pushes {pushes}"
                )
        if controller.weight_version != start_version + syncs:
            violations.append(f"seed {seed}: version {controller.weight_version} after {syncs} syncs")

    # the end: what a failed sync left suspended goes on, every chunk finishes, nothing is lost
    controller.resume(max_staleness)
    controller.quiesce()
    controller.evict_stale(max_staleness)
    account_evicted()
    while controller.buffered:
        check_drained(controller.drain_freshest(1, max_staleness))
    if len(trained) != len(set(trained)):
        violations.append(f"seed {seed}: {len(trained) - len(set(trained))} sample(s) trained twice")
    launched = set().union(*samples.values()) if samples else set()
    dropped_samples = set().union(*(samples[g] for g in dropped)) if dropped else set()
    accounted = set(trained) | evicted | dropped_samples
    if set(trained) & (evicted | dropped_samples) or evicted & dropped_samples:
        violations.append(f"seed {seed}: a sample counted twice (trained / evicted / dropped)")
    if accounted != launched:
        violations.append(f"seed {seed}: {len(launched - accounted)} sample(s) lost without a count")
    return {
        "operations": OPERATIONS,
        "syncs": syncs,
        "interrupted_jobs": controller.interrupted_jobs,
        "dropped_jobs": len(dropped),
        "samples": len(launched),
        "trained": len(trained),
        "evicted": len(evicted),
        "violations": violations,
    }


def test_interrupt_schedules_keep_the_contract(record_property: Any) -> None:
    runs = {seed: run_schedule(seed) for seed in SEEDS}
    violations = [v for run in runs.values() for v in run["violations"]]
    summary = {
        "seeds": f"{SEEDS.start}..{SEEDS.stop - 1}",
        "schedules": len(runs),
        "operations": sum(r["operations"] for r in runs.values()),
        "syncs": sum(r["syncs"] for r in runs.values()),
        "interrupted_jobs": sum(r["interrupted_jobs"] for r in runs.values()),
        "dropped_jobs": sum(r["dropped_jobs"] for r in runs.values()),
        "samples": sum(r["samples"] for r in runs.values()),
        "trained": sum(r["trained"] for r in runs.values()),
        "evicted": sum(r["evicted"] for r in runs.values()),
        "violations": len(violations),
    }
    print("interrupt property test:", json.dumps(summary))
    record_property("interrupt_property_summary", json.dumps(summary))
    assert not violations, violations[:10]
    # the schedules exercise what they claim to: interrupts, resumes across versions, drops
    assert summary["interrupted_jobs"] > 100 and summary["dropped_jobs"] > 0 and summary["trained"] > 1000


def test_a_sample_spans_versions_and_each_token_keeps_its_own() -> None:
    """One job interrupted twice: its long sample has tokens of three versions, each with its log-prob."""
    engine = SimEngine(random.Random(0), 0)
    engine.targets = {(0, 0, 0): MAX_NEW_TOKENS, (0, 0, 1): 2}
    controller = BatchRolloutController(
        lambda request: ChunkedGeneration(engine.launch, request, 4), complete=lambda g, v, r: r.groups
    )
    controller.submit(
        RolloutRequest([{"prompt": "", "index": 0}], 2, SamplingParams(max_new_tokens=12), gen_id=0)
    )
    for version in (1, 2):
        controller.quiesce(interrupt=True)
        assert (controller.inflight, controller.suspended) == (0, 1)
        controller.sync_weights(lambda v: setattr(engine, "version", v))
        assert controller.resume(max_staleness=2) == 1
        assert controller.weight_version == version
    controller.quiesce()
    [item] = controller.drain_freshest(1, max_staleness=2)
    long, short = item.group
    assert long.versions() == [0] * 4 + [1] * 4 + [2] * 4 and short.versions() == [0, 0]
    assert long.logprobs == [logprob(p, v) for p, v in enumerate(long.versions())]
    assert item.weight_version == 0  # the launch stamp is kept
    stats = token_version_stats([item.group], 2, 2)
    assert stats["rollout/interrupted_samples"] == 1 and stats["rollout/token_versions_max_spread"] == 2
    assert stats["rollout/token_staleness/2"] == 6 / 14


def test_a_suspended_job_over_the_bound_is_dropped_not_resumed() -> None:
    engine = SimEngine(random.Random(0), 0)
    engine.targets = {(0, 0, 0): MAX_NEW_TOKENS}
    controller = BatchRolloutController(
        lambda request: ChunkedGeneration(engine.launch, request, 4), complete=lambda g, v, r: r.groups
    )
    controller.submit(
        RolloutRequest([{"prompt": "", "index": 0}], 1, SamplingParams(max_new_tokens=12), gen_id=0)
    )
    controller.quiesce(interrupt=True)
    controller.sync_weights(lambda v: setattr(engine, "version", v))
    assert controller.resume(max_staleness=0) == 0
    assert controller.pop_dropped() == [(0, 0)] and controller.pop_dropped() == []
    assert (controller.inflight, controller.suspended, controller.buffered) == (0, 0, 0)


def test_interrupt_needs_placement_separate_and_the_message_names_both_keys() -> None:
    import pytest

    from tests.builders import rollout_settings
    from unirl_lightning.core.preflight import sync_mode_placement_error

    assert sync_mode_placement_error("interrupt", "separate") is None
    assert sync_mode_placement_error("quiesce", "colocate") is None
    with pytest.raises(
        ValueError, match=r"sync_mode='interrupt' needs placement='separate', got placement='colocate'"
    ):
        rollout_settings(placement="colocate", max_staleness=0, max_inflight=1, sync_mode="interrupt")
    with pytest.raises(
        ValueError, match=r"sync_mode must be one of \('quiesce', 'interrupt', 'continue'\), got 'abort'"
    ):
        rollout_settings(sync_mode="abort")
