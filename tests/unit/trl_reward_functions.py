"""Reward functions in the shapes users write them, for tests/unit/test_rewards_trl.py."""

from __future__ import annotations

import asyncio
import time

CALLS: list[int] = []  # batch sizes seen by ``counted`` (one entry per call)


def per_sample(completion, record):
    return float(completion == record["answer"])


def exact(completions, solution, **kwargs):
    return [float(c == s) for c, s in zip(completions, solution)]


def counted(completions, **kwargs):
    CALLS.append(len(completions))
    return [float(len(c)) for c in completions]


def sees_everything(completions, prompts, completion_ids, finish_reasons, level, **kwargs):
    return [
        float(len(ids)) + (10.0 if reason == "length" else 0.0) + lvl
        for ids, reason, lvl in zip(completion_ids, finish_reasons, level)
    ]


def only_declared(completions, prompts):
    return [float(p.endswith("=")) for p in prompts]


def needs_missing_column(completions, difficulty):
    return [0.0] * len(completions)


def no_opinion_on_odd(completions, **kwargs):
    return [None if i % 2 else 1.0 for i in range(len(completions))]


def always_none(completions, **kwargs):
    return [None] * len(completions)


async def slow_judge(completions, **kwargs):
    await asyncio.sleep(0.2)
    return [float(len(c)) for c in completions]


async def slow_per_sample(completion, record):
    await asyncio.sleep(0.2)
    return float(completion == record["answer"])


def failing(completions, **kwargs):
    raise KeyError("solution")


def wrong_length(completions, **kwargs):
    return [1.0]


def timed_per_sample(completion, record):
    time.sleep(0)
    return 1.0
