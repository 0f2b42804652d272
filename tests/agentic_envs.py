"""Environments for the agentic tests, importable by class path in the Ray workers (``tests.agentic_envs``)."""

from __future__ import annotations

import time
from typing import Any

from unirl_lightning.envs import Environment, StepResult


class CountdownEnv(Environment):
    """An episode of exactly ``record["turns"]`` model turns, whatever the model says.

    Observations are ``","``; the last step pays ``record["reward"]`` plus 0.1 per digit in the
    model's turns (so groups have reward variance). ``step_sleep_s`` makes every step slow (live
    episodes at a sync); ``record["crash_at"] = t`` makes step ``t`` raise. ``info["tool_calls"]``
    counts the turns so far.
    """

    def __init__(self, max_turns: int = 50, step_sleep_s: float = 0.0) -> None:
        super().__init__(max_turns)
        self.step_sleep_s = step_sleep_s
        self.digits = 0

    def on_reset(self, record: dict[str, Any]) -> str:
        self.digits = 0
        return record["prompt"]

    def on_step(self, assistant_text: str) -> StepResult:
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        if self.turn == self.record.get("crash_at"):
            raise RuntimeError(f"tool backend unavailable at turn {self.turn}")
        self.digits += sum(ch.isdigit() for ch in assistant_text)
        info = {"tool_calls": self.turn}
        if self.turn >= self.record["turns"]:
            return StepResult(None, self.record.get("reward", 0.0) + 0.1 * self.digits, done=True, info=info)
        return StepResult(",", 0.0, info=info)


def countdown_records(turns: list[int], **extra: Any) -> list[dict[str, Any]]:
    """One record per entry of ``turns`` (prompt ``"<turns>?"``), with ``extra`` keys."""
    return [{"prompt": f"{t}?", "turns": t, "answer": "", **extra} for t in turns]


def countdown_batches(
    num_prompts: int,
    seed: int = 0,
    split: str = "train",
    pattern: tuple[int, ...] = (1, 12),
    batch_size: int = 2,
    crash_every: int = 0,
) -> list[dict[str, Any]]:
    """A record generator (``EpisodeDataModule`` signature) whose consecutive batches of ``batch_size``
    records take ``pattern[b % len(pattern)]`` turns (short and long groups in turn); with
    ``crash_every=k`` every ``k``-th record's environment raises at turn 2."""
    turns = [pattern[(i // batch_size) % len(pattern)] for i in range(num_prompts)]
    records = countdown_records(turns)
    for i, record in enumerate(records):
        record["prompt"] = f"{i}?"
        if crash_every and i % crash_every == crash_every - 1:
            record["crash_at"] = 2
    return records
