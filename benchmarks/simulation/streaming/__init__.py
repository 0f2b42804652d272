"""Streaming engines on a discrete clock: the machinery of ``simulate_streaming.py``.

Units are *groups* (one prompt x ``samples`` rows). A group goes whole to the least-loaded engine (one
engine = ``tp`` GPUs); its rows take free slots (``max_rows`` rows, and a KV budget of ``kv_tokens``
context tokens checked when a row starts) and, with continuous batching, a finished row's slot is
refilled from the engine's queue at once, or once ``refill_at`` slots are free (``per_call``: only when
the engine's batch is empty, the per-call model of ``sim.py``). Every active row advances one token per
decode step, which costs ``a + b * rows + c * context_tokens`` seconds; a group's prompt costs
``prefill * prompt_len`` once, and a refill ``join_s`` (a prefill forward of its own: the HF engine's;
0 for engines that fold prefill into the decode step, as vLLM's and SGLang's chunked prefill does);
with ``stage`` (the HF engine's staged refill) one ``join_s`` prefills ``max_rows`` queued rows ahead,
and each row admitted costs ``refill_s`` more (its KV copied into its slot, its first token); with
``padded`` (the HF engine's left-padded cache) a step attends over the widest row's context for every
row. Between events (a row finishing, a group arriving, a pause) an engine's state evolves in closed
form: a run costs in rows, not in tokens.

A weight sync pauses every engine for the push; in-flight rows keep their tokens and continue under the
new version (optionally re-encoding ``resume_prefill`` of their context). Every row records the weight
version of each of its tokens (``segments``: ``[version, count]`` runs). ``trainer.GroupHandle`` is the
controller's ``GenerationHandle`` with ``SuspendedJobs``' interrupt API, so the real
``BatchRolloutController`` suspends, resumes and drops groups across a sync. Standard library only.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from typing import Any

from benchmarks.simulation.streaming.units import Group, Row

__all__ = ["Engine", "Group", "Row", "World"]

INF = float("inf")


class Engine:
    def __init__(self, world: World, index: int) -> None:
        self.world, self.index = world, index
        self.t = 0.0  # time of the last step boundary
        self.step = 0  # decode steps run
        self.rows = 0  # active rows
        self.ctx = 0  # context tokens of the active rows
        self.width = 0  # the widest active row's context (``padded``: every row costs as much)
        self.heap: list[tuple[int, int, Row]] = []  # (finish step, seq, row)
        self.queue: deque[Row] = deque()
        self.load = 0  # rows assigned and not finished (active + queued)
        self.epoch = 0
        self.row_seconds = 0.0  # integral of active rows over decode time
        self.busy = 0.0  # seconds computing (decode steps, prefills, joins): the loop's busy seconds
        self.joined_at = -1.0  # the world time of the last join (one forward for rows arriving together)
        self.staged = 0  # rows prefilled ahead (``stage``): refills that need no forward of their own
        self.starved = 0.0  # free slots x seconds with no row queued (the batcher's starved_slot_seconds)

    def attended(self) -> int:
        """Context tokens a decode step attends over: each row's own, or (``padded``, the HF engine's
        left-padded cache) the widest row's, for every row."""
        return self.rows * self.width if self.world.padded else self.ctx

    def cost(self, n: int) -> float:
        w = self.world
        return n * (w.a + w.b * self.rows + w.c * self.attended()) + w.c * self.rows * n * (n - 1) / 2

    def steps_by(self, t: float) -> int:
        """The most whole decode steps that end by ``t``."""
        budget = t - self.t
        if budget <= 0 or self.rows == 0:
            return 0
        w = self.world
        q = w.c * self.rows / 2
        lin = w.a + w.b * self.rows + w.c * self.attended() - q
        n = budget / lin if q == 0 else (-lin + math.sqrt(lin * lin + 4 * q * budget)) / (2 * q)
        n = int(n)
        while n > 0 and self.cost(n) > budget:
            n -= 1
        return n

    def advance(self, n: int) -> None:
        if n > 0:
            dt = self.cost(n)
            self.starve(dt)
            self.row_seconds += self.rows * dt
            self.busy += dt
            self.t += dt
            self.ctx += self.rows * n
            self.width += n
            self.step += n

    def next_finish(self) -> int | None:
        while self.heap and self.heap[0][2].cancelled:
            heapq.heappop(self.heap)
        return self.heap[0][0] if self.heap else None

    def fill(self) -> None:
        """Start queued rows in free slots (once ``refill_at`` are free, the queue fits or the batch is
        empty; per call: an empty batch only); a fill that starts rows costs ``join_s`` (a forward)."""
        w, before = self.world, self.rows
        free = w.max_rows - self.rows
        if self.rows and (w.per_call or (free < w.refill_at and free < len(self.queue))):
            return
        while self.queue and self.rows < w.max_rows:
            row = self.queue[0]
            if row.cancelled:
                self.queue.popleft()
                continue
            grow = row.group.prompt_len + row.tokens
            if w.kv_tokens and self.rows and self.ctx + grow > w.kv_tokens:
                break
            self.queue.popleft()
            group = row.group
            if not group.prefilled:
                group.prefilled = True
                self.spend(w.prefill * group.prompt_len, rows=False)
            row.mark, row.state = self.step, 1
            row.finish = self.step + row.target - row.tokens
            self.rows += 1
            self.ctx += grow
            w.seq += 1
            heapq.heappush(self.heap, (row.finish, w.seq, row))
        joined = self.rows - before
        if joined and w.refill_s:  # per admitted row: its KV copied into its slot, its first token
            self.spend(joined * w.refill_s)
        if joined and w.stage:  # staged refill: one forward prefills up to max_rows queued rows
            self.staged -= joined
            if self.staged < 0:
                self.staged += w.max_rows
                self.spend(w.join_s)
        elif joined and w.now > self.joined_at:  # rows that arrive together join in one forward
            self.joined_at = w.now
            self.spend(w.join_s)

    def spend(self, seconds: float, rows: bool = True) -> None:
        """A forward outside the decode steps (a prompt's prefill, a join); ``rows``: counted as busy for
        every active row, as the engine counts its steps."""
        self.starve(seconds)
        self.t += seconds
        self.busy += seconds
        self.row_seconds += self.rows * seconds if rows else 0.0

    def starve(self, seconds: float) -> None:
        """Count ``seconds`` of the free slots as starved when no row is queued."""
        while self.queue and self.queue[0].cancelled:  # as ``fill`` skips them
            self.queue.popleft()
        if not self.queue:
            self.starved += (self.world.max_rows - self.rows) * seconds

    def schedule(self) -> None:
        if self.world.padded:  # the widest active row now (rows started or finished since)
            live = [r for _, _, r in self.heap if r.state == 1 and not r.cancelled]
            self.width = max((r.group.prompt_len + r.tokens + self.step - r.mark for r in live), default=0)
        self.epoch += 1
        finish = self.next_finish()
        if finish is not None:
            heapq.heappush(
                self.world.events, (self.t + self.cost(finish - self.step), self.index, self.epoch)
            )

    def catch_up(self, t: float) -> None:
        """Run the whole steps that end by ``t`` (no row finishes before ``t``: the world ran those)."""
        if self.rows == 0:
            if t > self.t:  # idle: waiting for rows (a push moves ``t`` past ``now`` and is not idle)
                self.starve(t - self.t)
            self.t = max(self.t, t)
        else:
            self.advance(self.steps_by(t))

    def on_event(self) -> list[Group]:
        finish = self.next_finish()
        assert finish is not None
        self.advance(finish - self.step)
        done = []
        while self.heap and (self.heap[0][2].cancelled or self.heap[0][0] == self.step):
            _, _, row = heapq.heappop(self.heap)
            if row.cancelled:
                continue
            row.close(self.step, self.world.version)
            row.state = 2
            self.rows -= 1
            self.load -= 1
            self.ctx -= row.group.prompt_len + row.tokens
            group = row.group
            group.remaining -= 1
            if group.remaining == 0:
                group.done_at = self.t
                done.append(group)
        self.fill()
        self.schedule()
        return done


class World:
    """The engines, the clock and the weight version."""

    def __init__(self, cfg: Any, engines: int) -> None:
        self.a, self.b, self.c, self.prefill = cfg.a, cfg.b, cfg.c, cfg.prefill
        self.max_rows, self.kv_tokens, self.per_call = cfg.max_rows, cfg.kv_tokens, cfg.per_call
        self.resume_prefill = cfg.resume_prefill
        self.join_s, self.refill_at = getattr(cfg, "join_s", 0.0), getattr(cfg, "refill_at", 1)
        self.stage, self.padded = getattr(cfg, "stage", False), getattr(cfg, "padded", False)
        self.refill_s = getattr(cfg, "refill_s", 0.0)  # seconds per row admitted, beyond joins and prefill
        self.engines = [Engine(self, i) for i in range(engines)]
        self.events: list[tuple[float, int, int]] = []
        self.now, self.version, self.seq = 0.0, 0, 0
        self.paused_s = 0.0
        self.rng = random.Random(cfg.seed)
        self.median, self.sigma, self.cap = cfg.median_len, cfg.sigma, cfg.max_new_tokens
        self.prompt_len, self.samples = cfg.prompt_len, cfg.samples
        self.lengths = getattr(cfg, "lengths", None)  # measured lengths, drawn with replacement

    def draw(self) -> int:
        if self.lengths:
            return max(1, min(self.cap, self.rng.choice(self.lengths)))
        n = round(math.exp(math.log(self.median) + self.sigma * self.rng.gauss(0, 1)))
        return max(1, min(self.cap, n))

    def new_group(self, gen_id: int) -> Group:
        return Group(gen_id, [self.draw() for _ in range(self.samples)], self.prompt_len)

    def add(self, group: Group) -> None:
        """Send ``group`` to the least-loaded engine, at ``now``."""
        engine = min(self.engines, key=lambda e: e.load)
        engine.catch_up(self.now)
        group.engine = engine
        engine.queue.extend(group.rows)
        engine.load += len(group.rows)
        engine.fill()
        engine.schedule()

    def cancel(self, group: Group) -> int:
        """Drop ``group``'s rows from its engine (a dropped group); returns the tokens thrown away."""
        engine = group.engine
        assert engine is not None
        engine.catch_up(self.now)
        for row in group.rows:
            if row.cancelled or row.state == 2:
                continue
            if row.state == 1:
                row.close(engine.step, self.version)
                engine.rows -= 1
                engine.ctx -= row.group.prompt_len + row.tokens
            row.cancelled = True
            engine.load -= 1
        engine.fill()
        engine.schedule()
        return sum(row.tokens for row in group.rows)

    def advance(self, until: float = INF) -> list[Group]:
        """Run events up to ``until``; stop after the first that completes groups (returned)."""
        while self.events:
            t, index, epoch = self.events[0]
            if t > until:
                break
            heapq.heappop(self.events)
            engine = self.engines[index]
            if epoch != engine.epoch:
                continue
            self.now = max(self.now, t)
            done = engine.on_event()
            if done:
                return done
        if until < INF:
            self.now = max(self.now, until)
        return []

    def run_until(self, group: Group) -> None:
        while group.remaining:
            if not self.events:
                raise RuntimeError(f"group {group.gen_id} can never finish (no engine event left)")
            self.advance()

    def pause(self, seconds: float, new_version: int) -> None:
        """A weight push at ``now``: every engine stops for ``seconds``; in-flight rows keep their tokens
        and go on under ``new_version`` (re-encoding ``resume_prefill`` of their context)."""
        for engine in self.engines:
            engine.catch_up(self.now)
            for _, _, row in engine.heap:
                if not row.cancelled:
                    row.close(engine.step, self.version)
            stall = self.resume_prefill * self.prefill * engine.ctx if engine.rows else 0.0
            engine.t = max(engine.t, self.now) + seconds + stall
            engine.schedule()
        self.version = new_version
        self.now += seconds
        self.paused_s += seconds

    def row_seconds(self) -> float:
        return sum(e.row_seconds for e in self.engines)

    def counters(self) -> tuple[float, float, int, float]:
        """Summed over the engines, as of ``now``: row-seconds, busy seconds, decode steps and starved
        slot-seconds."""
        busy, steps = sum(e.busy for e in self.engines), sum(e.step for e in self.engines)
        idle = [max(0.0, self.now - e.t) for e in self.engines if not (e.rows or e.queue)]
        starved = sum(e.starved for e in self.engines) + self.max_rows * sum(idle)  # the idle so far
        return self.row_seconds(), busy, steps, starved
