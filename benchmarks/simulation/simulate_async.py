"""Predict what async and interruptible generation buy at 8-128 GPUs: the REAL controller and loop
(``BatchRolloutController``, ``ChunkedGeneration``, ``RolloutLoop``) driven on a discrete clock by
simulated engines and a simulated trainer. Standard library only.

    python benchmarks/simulate_async.py                      # the 8 / 32 / 128-GPU table
    python benchmarks/simulate_async.py --calibrate benchmarks/results/interrupt_long_tail.json

Model (every number is a flag):

* Engines: ``E`` instances of one GPU each, each serving the parts of requests one at a time in
  launch order (as our workers do). A decode step with ``b`` rows in the batch takes
  ``step_s * (1 + b / half_batch)`` (the batch-size curve: throughput ``b / step`` saturates at
  ``half_batch / step_s`` tokens/s per GPU); rows leave the batch as they finish. Each call (and each
  resumed chunk) pays a prefill of ``prefill_s_per_token`` per prompt + partial token.
* Lengths: ``long_tail`` draws a lognormal (median ``median_len``, sigma ``sigma``) clipped at
  ``max_new_tokens``, the shape of published reasoning-length histograms (a mode well below the
  budget and a mass at the cap); or ``--lengths FILE`` (a JSON list, e.g. measured lengths).
* Trainer: ``T`` GPUs, ``train_s_per_token`` seconds per trained token per GPU; a push takes
  ``model_gb * push_s_per_gb`` (all the trainer's time: async training does not overlap the push).
* Modes, as the runtime runs them: ``sync`` (colocated: all ``E + T`` GPUs generate, then all train;
  ``max_staleness=0, max_inflight=1``), ``async_quiesce`` and ``async_interrupt`` (``E`` engine GPUs,
  ``T`` trainer GPUs, ``max_staleness=1, max_inflight=2``); every step: train, then
  ``quiesce(interrupt=...)``, push, ``sync_weights``, ``resume`` (the runtime's order).

Reports trained tokens/s, engine idle fraction, mean quiesce seconds, and the staleness histogram of
the trained tokens (the loop's ``rollout/token_staleness/k``).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from unirl_lightning.rollout.controller import BatchRolloutController  # noqa: E402
from unirl_lightning.rollout.interrupts import ChunkedGeneration  # noqa: E402
from unirl_lightning.rollout.loop import RolloutLoop  # noqa: E402
from unirl_lightning.rollout.records import Rollout, RolloutRequest, SamplingParams  # noqa: E402


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

    def result(self) -> dict[str, Any]:
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
        return {"groups": groups, "generate_s": 0.0, "score_s": 0.0, "spans": []}


class Sim:
    def __init__(
        self,
        args: argparse.Namespace,
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

        controller = BatchRolloutController(launch, complete=lambda g, v, r: r["groups"])
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


def simulate(args: argparse.Namespace, gpus: int, lengths: list[int] | None) -> dict[str, Any]:
    trainer = max(1, round(gpus * args.trainer_share))
    engines = gpus - trainer
    out = {}
    for mode in ("sync", "async_quiesce", "async_interrupt"):
        e, t = (gpus, gpus) if mode == "sync" else (engines, trainer)
        out[mode] = Sim(args, mode, e, t, lengths).run(args.steps)
    sync = out["sync"]["tokens_per_s"]
    for mode in out:
        out[mode]["over_sync"] = out[mode]["tokens_per_s"] / sync
    return {"gpus": gpus, "trainer_gpus": trainer, "engine_gpus": engines, **out}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument(
        "--trainer-share", type=float, default=0.25, help="fraction of the GPUs that train (async)"
    )
    p.add_argument("--prompts", type=int, default=64, help="prompts per step")
    p.add_argument("--samples", type=int, default=16, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=16384)
    p.add_argument("--median-len", type=float, default=3000)
    p.add_argument("--sigma", type=float, default=0.9)
    p.add_argument("--lengths", help="a JSON file: a list of completion lengths to draw from")
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--step-s", type=float, default=0.02, help="decode step of an empty-ish batch, per GPU")
    p.add_argument("--half-batch", type=float, default=128, help="rows at which a step takes twice as long")
    p.add_argument("--prefill-s-per-token", type=float, default=2e-6)
    p.add_argument(
        "--train-s-per-token", type=float, default=2.5e-4, help="per trained token per trainer GPU"
    )
    p.add_argument("--model-gb", type=float, default=16)
    p.add_argument("--push-s-per-gb", type=float, default=0.5)
    p.add_argument("--chunk", type=int, default=512, help="interrupt_chunk_tokens")
    p.add_argument("--block", type=int, default=64, help="decode steps simulated at once (resolution)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibrate", help="a results JSON of benchmarks/interrupt_long_tail.py")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "simulate_async.json"))
    return p


def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """Simulate the measured tiny workload (one worker, one trainer, the phase costs measured there)
    and compare the predicted async/sync ratios with the measured ones."""
    record = json.loads(Path(args.calibrate).read_text())
    config, med = record["summary"]["config"], record["summary"]["medians"]
    sync_runs = [r for r in record["runs"] if r["mode"] == "sync"]
    lengths = [n for r in sync_runs for n in r["completion_lengths"]]
    rows = config["batch"] * config["group"]
    tokens_per_step = sum(lengths) / len(lengths) * rows
    sim = argparse.Namespace(**{**vars(args)})
    sim.prompts, sim.samples, sim.max_new_tokens = config["batch"], config["group"], config["max_new_tokens"]
    sim.chunk, sim.block, sim.prompt_len, sim.steps, sim.warmup = (
        config["chunk"],
        1,
        12,
        config["steps"],
        config["warmup"],
    )
    # phase costs: the sync run's generation per request is a batch of `rows` rows as long as its longest
    sim.half_batch = 1e9  # CPU: a decode step costs the same for any batch that fits (measured below)
    sim.step_s = med["sync"]["generate_s"] / config["max_new_tokens"]
    sim.prefill_s_per_token = 0.0
    sim.train_s_per_token = med["sync"]["train_s"] / tokens_per_step
    sim.model_gb, sim.push_s_per_gb = 1.0, med["sync"]["push_s"]
    out = {}
    for mode in ("sync", "async_quiesce", "async_interrupt"):
        out[mode] = Sim(sim, mode, 1, 1, lengths).run(sim.steps)
    predicted = {m: out[m]["tokens_per_s"] / out["sync"]["tokens_per_s"] for m in out}
    measured = {m: med[m]["tokens_per_s"] / med["sync"]["tokens_per_s"] for m in out}
    return {
        "predicted_over_sync": predicted,
        "measured_over_sync": measured,
        "relative_error": {m: predicted[m] / measured[m] - 1 for m in out},
        "phase_costs": {
            k: getattr(sim, k) for k in ("step_s", "train_s_per_token", "push_s_per_gb", "chunk")
        },
    }


def main() -> None:
    args = parser().parse_args()
    lengths = json.loads(Path(args.lengths).read_text()) if args.lengths else None
    record: dict[str, Any] = {
        "assumptions": {k: v for k, v in vars(args).items() if k not in ("out", "calibrate")}
    }
    if args.calibrate:
        record["calibration"] = calibrate(args)
        print("calibration:", json.dumps(record["calibration"], indent=1))
    record["predictions"] = [simulate(args, gpus, lengths) for gpus in args.gpus]
    print(
        f"{'GPUs':>5} {'mode':<16} {'tok/s':>10} {'x sync':>7} {'idle':>6} {'quiesce s':>10} {'stale-1':>8}"
    )
    for row in record["predictions"]:
        for mode in ("sync", "async_quiesce", "async_interrupt"):
            r = row[mode]
            idle = "-" if r["engine_idle"] is None else f"{r['engine_idle']:.2f}"
            print(
                f"{row['gpus']:>5} {mode:<16} {r['tokens_per_s']:>10.0f} {r['over_sync']:>7.2f} {idle:>6} {r['quiesce_s']:>10.1f} {r['token_staleness'][1]:>8.3f}"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({"out": args.out}))


if __name__ == "__main__":
    main()
