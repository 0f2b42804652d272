"""Pins ``rollout/reward_timeouts``: the checks a reward gave up on (math_verify's timeout) travel
from the worker that scored them, through merged and chunked results, to the step's stats, counted
once each and summed over the run."""

from __future__ import annotations

import pytest

pytest.importorskip("math_verify")

from tests.fakes import FakeGenerationHandle  # noqa: E402
from tests.unit.test_loop import batches, make_loop  # noqa: E402
from unirl_lightning.rewards import CombinedReward, FormatReward, MathVerifyReward  # noqa: E402
from unirl_lightning.rollout.records import GenerationResult, Rollout, RolloutRequest  # noqa: E402
from unirl_lightning.workers.actor import RolloutWorker, reward_timeouts  # noqa: E402
from unirl_lightning.workers.calls import merge_results  # noqa: E402

SLOW = "8888** 8** 8"  # sympy builds 8888**(8**8): math_verify runs out of its timeout


def rollout(text, prompt="p", reward=0.0):
    return Rollout(
        prompt_ids=[1], completion_ids=[2], logprobs=[-0.5], reward=reward, finish_reason="stop",
        prompt=prompt, text=text,
    )  # fmt: skip


class _Engine:
    def __init__(self, texts):
        self.texts = texts

    def generate(self, request):
        return [[rollout(text) for text in self.texts] for _ in request.records]


class _Config:
    def __init__(self, texts):
        self.texts = texts

    def build(self, policy, lora):
        return _Engine(self.texts)


def test_a_worker_reports_the_timeouts_of_its_own_scoring_once_each():
    reward = CombinedReward([MathVerifyReward(timeout_seconds=1), FormatReward(r"\d")])
    worker = RolloutWorker(_Config([SLOW, SLOW, "5"]), None, None, reward)
    request = RolloutRequest(records=[{"prompt": "p", "answer": "5"}], n=3)
    first = worker.generate(request)
    assert [r.reward_parts["math_verify"] for r in first.groups[0]] == [0.0, 0.0, 1.0]
    assert first.reward_timeouts == 1 and reward_timeouts(reward) == 1  # the repeat is cached
    assert worker.generate(request).reward_timeouts == 0  # cached across calls too


def test_merged_parts_sum_their_timeouts():
    parts = [GenerationResult([[rollout("1")]], reward_timeouts=k) for k in (2, 0, 3)]
    assert merge_results(parts).reward_timeouts == 5


def test_the_loop_logs_the_runs_total_only_once_a_check_gave_up():
    counts = iter([0, 0, 2, 1])

    def generate(request):
        groups = [[rollout(str(k), r["prompt"], float(k)) for k in range(2)] for r in request.records]
        return FakeGenerationHandle(GenerationResult(groups, reward_timeouts=next(counts)), ready=True)

    loop, ctl = make_loop(batches(4), generate=generate)
    logged = []
    for _ in range(4):
        logged.append(loop.next_batch().stats.get("rollout/reward_timeouts"))
        ctl.sync_weights(lambda version: None)
    assert logged == [None, None, 2.0, 3.0]
