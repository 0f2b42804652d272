"""The simulated machinery of ``simulate_async.py``: a discrete clock, engine instances serving request
parts in launch order, the interrupt signal, and :class:`Sim`, which drives the REAL
``BatchRolloutController``, ``ChunkedGeneration`` and ``RolloutLoop`` with them and a simulated trainer
(the model is described in ``simulate_async.py``). Standard library and the library only.
"""

from __future__ import annotations

import bisect
import math
import random
from types import SimpleNamespace
from typing import Any

from benchmarks.harness import common  # noqa: F401 - this checkout first on sys.path
from unirl_lightning.rollout.controller import BatchRolloutController
from unirl_lightning.rollout.interrupts import ChunkedGeneration
from unirl_lightning.rollout.loop import RolloutLoop
from unirl_lightning.rollout.records import GenerationResult, Rollout, RolloutRequest, SamplingParams


class Clock:
    """The discrete clock: the simulation moves it, the loop reads it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def at_least(self, t: float) -> None:
        self.now = max(self.now, t)


class Signal:
    """The simulated InterruptSignal: bump times, by epoch."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.epoch, self.bumps = clock, 0, []

    def bump(self) -> None:
        self.epoch += 1
        self.bumps.append(self.clock.now)

    def fired_at(self, epoch: int) -> float | None:
        return self.bumps[epoch] if epoch < len(self.bumps) else None


class Part:
    """One worker call: the rows of a request part, generated chunk after chunk until done or interrupted."""

    def __init__(
        self, sim: Sim, request: RolloutRequest, rows: list[tuple[int, int, Any]], launched: float
    ) -> None:
        self.sim, self.request, self.rows, self.launched = sim, request, rows, launched
        self.start: float | None = None
        self.end: float | None = None
        self.steps_done = 0  # decode steps run (every row advances one token per step while active)
        self.finished_at: float | None = None  # final once the clock passed it

    def plan(self, start: float) -> tuple[float, int]:
        """(end, steps run) from ``start``, given the bumps so far."""
        sim, request = self.sim, self.request
        remaining = sorted(
            sim.target(request.gen_id, i, row.sample) - len(row.completion_ids) for i, _, row in self.rows
        )
        prefix = sum(sim.prompt_len + len(row.completion_ids) for _, _, row in self.rows)
        bump = None
        if request.interrupt_signal is not None:
            bump = request.interrupt_signal.fired_at(request.interrupt_epoch)
        chunk = request.chunk_tokens or (remaining[-1] if remaining else 1)
        t, steps = start, 0
        longest = remaining[-1] if remaining else 0
        while steps < longest:
            if bump is not None and bump <= t:
                break
            active = len(remaining) - bisect.bisect_right(remaining, steps)
            t += sim.prefill_s_per_token * (prefix + active * steps)  # each chunk re-encodes prompt + partial
            block = min(chunk, longest - steps)
            for s in range(steps, steps + block, sim.block):
                active = len(remaining) - bisect.bisect_right(remaining, s)
                t += min(sim.block, steps + block - s) * sim.step_s * (1 + active / sim.half_batch)
            steps += block
            if request.interrupt_signal is None:
                break  # one chunk per call
        return t, steps


class Instance:
    def __init__(self) -> None:
        self.parts: list[Part] = []
        self.busy_s = 0.0


class Handle:
    """The GenerationHandle of one request over the engine instances (one part per instance)."""

    def __init__(self, sim: Sim, request: RolloutRequest) -> None:
        self.sim, self.request = sim, request
        self.parts: list[tuple[Instance, Part]] = []
        rows = [(i, p, row) for i, group in enumerate(request.partial) for p, row in enumerate(group)]
        k = len(sim.instances)
        size = -(-len(rows) // k)
        for index, instance in enumerate(sim.instances):
            mine = rows[index * size : (index + 1) * size]
            if mine:
                part = Part(sim, request, mine, sim.clock.now)
                instance.parts.append(part)
                self.parts.append((instance, part))

    def _end(self) -> float:
        return max(self.sim.settle(instance, part) for instance, part in self.parts)

    def ready(self) -> bool:
        return self._end() <= self.sim.clock.now

    def wait(self) -> None:
        self.sim.clock.at_least(self._end())

    def result(self) -> GenerationResult:
        self.wait()
        groups = [[None] * len(g) for g in self.request.partial]
        for _instance, part in self.parts:
            for i, p, row in part.rows:
                target = self.sim.target(self.request.gen_id, i, row.sample)
                new = min(part.steps_done, target - len(row.completion_ids))
                total = len(row.completion_ids) + new
                finish = "length" if total >= target else "aborted"
                groups[i][p] = Rollout(
                    prompt_ids=[0],
                    completion_ids=list(row.completion_ids) + [1] * new,
                    logprobs=list(row.logprobs) + [0.0] * new,
                    token_versions=list(row.token_versions) + [self.sim.version] * new,
                    reward=0.0,
                    finish_reason=finish,
                    gen_id=self.request.gen_id,
                    weight_version=self.sim.version,
                )
        return GenerationResult(groups=groups, generate_s=0.0, score_s=0.0)


class Sim:
    def __init__(
        self,
        args: Any,
        mode: str,
        engine_gpus: int,
        trainer_gpus: int,
        lengths: list[int] | None,
    ) -> None:
        self.args, self.mode = args, mode
        self.clock = Clock()
        self.instances = [Instance() for _ in range(engine_gpus)]
        self.trainer_gpus = trainer_gpus
        self.step_s, self.half_batch, self.prefill_s_per_token = (
            args.step_s,
            args.half_batch,
            args.prefill_s_per_token,
        )
        self.block = max(1, args.block)
        self.prompt_len = args.prompt_len
        self.rng = random.Random(args.seed)
        self.lengths = lengths
        self.targets: dict[tuple[int, int, int], int] = {}
        self.version = 0

    def target(self, gen_id: int, record: int, sample: int) -> int:
        key = (gen_id, record, sample)
        if key not in self.targets:
            a = self.args
            if self.lengths:
                n = self.rng.choice(self.lengths)
            else:
                n = int(round(math.exp(math.log(a.median_len) + a.sigma * self.rng.gauss(0, 1))))
            self.targets[key] = max(1, min(a.max_new_tokens, n))
        return self.targets[key]

    def settle(self, instance: Instance, part: Part) -> float:
        """The end of ``part`` on ``instance`` (its predecessors first), with the bumps so far."""
        t = 0.0
        for other in instance.parts:
            if other.finished_at is not None:
                t = other.finished_at
            else:
                start = max(other.launched, t)
                end, steps = other.plan(start)
                other.start, other.end, other.steps_done = start, end, steps
                if end <= self.clock.now:
                    other.finished_at = end
                    instance.busy_s += end - start
                t = end
            if other is part:
                return t
        raise AssertionError("part not on its instance")

    def run(self, steps: int) -> dict[str, Any]:
        a = self.args
        interrupt = self.mode == "async_interrupt"
        staleness, inflight = (0, 1) if self.mode == "sync" else (1, 2)
        signal = Signal(self.clock)
        chunk = a.chunk if interrupt else 1 << 30

        def launch(request: RolloutRequest) -> ChunkedGeneration:
            return ChunkedGeneration(lambda r: Handle(self, r), request, chunk, signal)

        controller = BatchRolloutController(launch, complete=lambda g, v, r: r.groups)
        prompts = ([{"prompt": ""}] * a.prompts for _ in iter(int, 1))
        tokens_trained = 0
        histogram = [0, 0]
        quiesce = 0.0

        def collate(groups: list[list[Any]]) -> Any:
            return SimpleNamespace(stats={}, groups=groups)

        loop = RolloutLoop(
            prompts,
            controller,
            collate=collate,
            build_request=lambda records, gen_id: RolloutRequest(
                records, a.samples, SamplingParams(max_new_tokens=a.max_new_tokens), gen_id=gen_id
            ),
            max_staleness=staleness,
            max_inflight=inflight,
            sync_interval=1,
            clock=self.clock,
            wall_clock=self.clock,
        )
        started = None
        for step in range(steps + a.warmup):
            if step == a.warmup:
                started, tokens_trained, histogram, quiesce = self.clock.now, 0, [0, 0], 0.0
                for instance in self.instances:
                    instance.busy_s = 0.0
            batch = loop.next_batch()
            n_tokens = sum(len(r.completion_ids) for g in batch.groups for r in g)
            tokens_trained += n_tokens
            for k in range(2):
                histogram[k] += batch.stats.get(f"rollout/token_staleness/{k}", 0.0) * n_tokens
            self.clock.now += n_tokens * a.train_s_per_token / self.trainer_gpus
            t0 = self.clock.now
            controller.quiesce(interrupt=interrupt)
            quiesce += self.clock.now - t0

            def push(version: int) -> None:
                self.clock.now += a.model_gb * a.push_s_per_gb
                self.version = version

            controller.sync_weights(push)
            if interrupt:
                controller.resume(staleness)
        elapsed = self.clock.now - started
        for instance in self.instances:  # count the work of parts that ended after the last settle
            for part in instance.parts:
                self.settle(instance, part)
        busy = sum(i.busy_s for i in self.instances)
        return {
            "tokens_per_s": tokens_trained / elapsed,
            "engine_idle": max(0.0, 1 - busy / (len(self.instances) * elapsed))
            if self.mode != "sync"
            else None,
            "quiesce_s": quiesce / steps,
            "token_staleness": [h / max(1, tokens_trained) for h in histogram],
            "interrupt_dropped": loop.interrupt_dropped,
            "evicted_groups": loop.evicted_groups,
        }
