"""Reward functions as users write them: per sample, TRL-style batched (keyword columns, ``None`` =
no opinion), async, combined with weights (each reward's own scores), and clear failures."""

from __future__ import annotations

import asyncio
import pickle
import time

import pytest

from tests.unit import trl_reward_functions as fns
from unirl_lightning.rewards import (
    CallableReward,
    CombinedReward,
    ExactMatchReward,
    RewardError,
    is_batched_function,
    part_name,
    score_batch,
    score_parts,
)
from unirl_lightning.rollout.loop import reward_part_means
from unirl_lightning.rollout.records import Rollout

MOD = "tests.unit.trl_reward_functions"
RECORDS = [
    {"prompt": "1=", "answer": "2", "solution": "2", "level": 1},
    {"prompt": "2=", "answer": "3", "solution": "3", "level": 2},
]


def test_the_calling_rule_is_read_off_the_first_parameter():
    assert is_batched_function(fns.exact) and is_batched_function(fns.slow_judge)
    assert not is_batched_function(fns.per_sample) and not is_batched_function(len)
    # per sample keeps today's meaning
    assert score_batch(f"{MOD}:per_sample", ["2", "x"], RECORDS) == [1.0, 0.0]


def test_a_trl_function_gets_prompts_and_every_column_as_keywords():
    assert score_batch(f"{MOD}:exact", ["2", "4"], RECORDS) == [1.0, 0.0]
    assert score_batch(f"{MOD}:only_declared", ["a", "b"], RECORDS) == [1.0, 1.0]  # no **kwargs: only its own


def test_a_trl_function_gets_completion_ids_and_finish_reasons_when_it_takes_them():
    scores = score_batch(
        f"{MOD}:sees_everything",
        ["a", "b"],
        RECORDS,
        completion_ids=[[1, 2], [3]],
        finish_reasons=["stop", "length"],
    )
    assert scores == [2.0 + 1, 1.0 + 10 + 2]


def test_a_missing_column_names_the_function_the_argument_and_the_keys():
    with pytest.raises(
        RewardError,
        match=r"needs_missing_column.*needs the keyword argument\(s\) \['difficulty'\].*'solution'",
    ):
        score_batch(f"{MOD}:needs_missing_column", ["a", "b"], RECORDS)


def test_none_is_no_opinion_and_a_sample_everyone_says_none_to_scores_zero():
    assert score_batch(f"{MOD}:always_none", ["a", "b"], RECORDS) == [0.0, 0.0]
    combined = CombinedReward([f"{MOD}:no_opinion_on_odd", f"{MOD}:exact"], weights=[0.5, 2.0])
    totals, parts = score_parts(combined, ["2", "3", "x"], [*RECORDS, RECORDS[0]])
    assert totals == [2.5, 2.0, 0.5]  # the None of sample 1 is left out of its sum
    assert parts == {"no_opinion_on_odd": [1.0, None, 1.0], "exact": [1.0, 1.0, 0.0]}
    everyone_none = CombinedReward([f"{MOD}:always_none", f"{MOD}:always_none"])
    assert score_parts(everyone_none, ["a"], RECORDS[:1]) == (
        [0.0],
        {"always_none": [None], "always_none_2": [None]},
    )


def test_a_none_from_a_reward_class_is_still_an_error():
    class Nones(ExactMatchReward):
        def __call__(self, completions, records):
            return [None] * len(completions)

    with pytest.raises(RewardError, match=r"returned score None at index 0; expected a finite float\."):
        score_batch(Nones(), ["a"], RECORDS[:1])


def test_per_reward_names_are_the_functions_or_the_reward_classes():
    combined = CombinedReward([f"{MOD}:exact", ExactMatchReward(), fns.counted])
    assert [part_name(r) for r in combined.rewards] == ["exact", "exact_match", "counted"]
    assert part_name(CallableReward(f"{MOD}.per_sample")) == "per_sample"
    assert part_name(CallableReward(fns.exact, name="mine")) == "mine"


def test_a_batched_function_is_called_once_per_batch():
    fns.CALLS.clear()
    score_batch(f"{MOD}:counted", ["a", "bb", "ccc"], [RECORDS[0]] * 3)
    assert fns.CALLS == [3]


def test_an_async_batched_function_is_awaited():
    assert score_batch(f"{MOD}:slow_judge", ["ab", "c"], RECORDS) == [2.0, 1.0]


def test_async_per_sample_calls_of_a_batch_run_concurrently():
    start = time.perf_counter()
    assert score_batch(f"{MOD}:slow_per_sample", ["2", "x"] * 4, RECORDS * 4) == [1.0, 0.0] * 4
    assert time.perf_counter() - start < 0.6  # 8 calls of 0.2 s, gathered


def test_an_async_reward_also_runs_where_an_event_loop_is_running():
    async def inside_a_loop():
        return score_batch(f"{MOD}:slow_judge", ["ab"], RECORDS[:1])

    assert asyncio.run(inside_a_loop()) == [2.0]


def test_a_failing_function_names_itself_and_the_prompt():
    with pytest.raises(RewardError) as info:
        score_batch(CombinedReward([f"{MOD}:exact", f"{MOD}:failing"]), ["2", "3"], RECORDS)
    message = str(info.value)
    assert f"'{MOD}:failing'" in message and "'1='" in message and "KeyError" in message
    assert message.count("reward '") == 1  # named once, not wrapped again by the combination
    with pytest.raises(RewardError, match=r"wrong_length.*returned 1 scores; expected 2"):
        score_batch(f"{MOD}:wrong_length", ["a", "b"], RECORDS)


def test_a_reward_file_path_is_imported_and_pickles_as_its_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def starts(completions, solution, **kwargs):\n    return [float(c.startswith(s)) for c, s in zip(completions, solution)]\n"
    )
    monkeypatch.chdir(tmp_path)
    reward = CallableReward("my_rewards.py:starts")
    assert reward.name == "my_rewards.py:starts" and part_name(reward) == "starts"
    assert reward.fn == f"{tmp_path / 'my_rewards.py'}:starts"
    restored = pickle.loads(pickle.dumps(reward))
    monkeypatch.chdir("/")
    assert score_batch(restored, ["2!", "x"], RECORDS) == [1.0, 0.0]


def test_reward_parts_means_leave_out_no_opinion():
    rows = [
        Rollout([1], [2], [0.0], 1.0, "stop", reward_parts={"exact": 1.0, "judge": 0.5}),
        Rollout([1], [2], [0.0], 0.0, "stop", reward_parts={"exact": 0.0}),
    ]
    assert reward_part_means(rows) == {"rollout/reward/exact_mean": 0.5, "rollout/reward/judge_mean": 0.5}
    assert reward_part_means(rows, prefix="eval/reward/") == {
        "eval/reward/exact_mean": 0.5,
        "eval/reward/judge_mean": 0.5,
    }


def test_the_worker_scores_a_request_once_and_keeps_each_rollouts_parts():
    from types import SimpleNamespace

    from unirl_lightning.workers.actor import RolloutWorker

    fns.CALLS.clear()

    class Engine:
        def generate(self, request):
            return [
                [Rollout([1], [5, 6], [0.0, 0.0], 0.0, "stop", text=t) for t in ("2", "22")]
                for _ in request.records
            ]

    worker = RolloutWorker.__new__(RolloutWorker)
    worker.engine = Engine()
    worker.reward = CombinedReward(
        [f"{MOD}:exact", f"{MOD}:counted", f"{MOD}:no_opinion_on_odd"], weights=[1.0, 0.5, 1.0]
    )
    result = worker.generate(SimpleNamespace(records=RECORDS))
    assert fns.CALLS == [4]  # one call for both groups
    first, second = result.groups
    assert [r.reward for r in first] == [1.0 + 0.5 + 1.0, 0.0 + 1.0]
    assert first[0].reward_parts == {"exact": 1.0, "counted": 1.0, "no_opinion_on_odd": 1.0}
    assert first[1].reward_parts == {"exact": 0.0, "counted": 2.0}
    assert [r.reward for r in second] == [0.0 + 0.5 + 1.0, 0.0 + 1.0]
