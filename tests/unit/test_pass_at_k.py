"""pass@k (the unbiased estimator, by hand), mean@n and maj@n (math-verify's majority answer)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from unirl_lightning.callbacks import RolloutEvalCallback
from unirl_lightning.callbacks.eval import group_metrics, majority_correct, mean_pass_at_k, pass_at_k


def test_pass_at_k_by_hand():
    # n=5, c=2: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10; pass@3 = 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert pass_at_k(5, 2, 4) == 1.0  # n - c < k: every draw of 4 holds a correct one
    assert pass_at_k(5, 0, 5) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    # averaged over prompts: (0.4 + 0.0) / 2 at k=1, (0.7 + 0.0) / 2 at k=2
    assert mean_pass_at_k([(5, 2), (5, 0)], 1) == pytest.approx(0.2)
    assert mean_pass_at_k([(5, 2), (5, 0)], 2) == pytest.approx(0.35)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 1, 0), (4, 1, 5), (4, 5, 1)])
def test_pass_at_k_refuses_impossible_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass@k"):
        pass_at_k(n, c, k)


def test_majority_vote_groups_equal_answers_and_skips_unparsable_ones():
    pytest.importorskip("math_verify")
    # "4" twice (one written 4.0) beats "5" once; the unparsable completion does not vote
    assert majority_correct(["5", "4", "no answer here", "4.0"], "4")
    assert not majority_correct(["5", "5", "4"], "4")
    assert not majority_correct(["???", "..."], "4")  # nothing parsable: wrong
    assert majority_correct(["4", "5"], "4")  # a tie goes to the answer given first


def rollout(reward: float, text: str = ""):
    return SimpleNamespace(reward=reward, text=text)


def test_group_metrics():
    pytest.importorskip("math_verify")
    groups = [
        [rollout(1.0, "4"), rollout(0.0, "5"), rollout(1.0, "4"), rollout(0.0, "x")],  # c=2, majority 4
        [rollout(0.0, "7"), rollout(0.0, "7"), rollout(0.0, "8"), rollout(1.0, "3")],  # c=1, majority 7
    ]
    records = [{"prompt": "a", "answer": "4"}, {"prompt": "b", "answer": "3"}]
    metrics = group_metrics(groups, records, 1.0, [1, 2, 4], "answer")
    assert metrics["eval/pass@1"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert metrics["eval/pass@2"] == pytest.approx(((1 - 1 / 6) + (1 - 3 / 6)) / 2)
    assert metrics["eval/pass@4"] == 1.0
    assert metrics["eval/mean@4"] == pytest.approx(0.375)
    assert metrics["eval/maj@4"] == 0.5
    no_answers = group_metrics(groups, [{"prompt": "a"}, {"prompt": "b"}], 1.0, [1], "answer")
    assert "eval/maj@4" not in no_answers


def test_callback_logs_pass_at_1_and_n_and_checks_pass_k():
    assert RolloutEvalCallback(num_generations=4).pass_k == [1, 4]
    assert RolloutEvalCallback(num_generations=8, pass_k=[2, 4]).pass_k == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="pass_k"):
        RolloutEvalCallback(num_generations=4, pass_k=[5])


def test_eval_prompts_from_a_file_with_other_column_names_use_prompt_key_and_the_answer_key(tmp_path):
    path = tmp_path / "held_out.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"{i}+1=", "solution": str(i + 1)}) + "\n" for i in range(3))
    )
    callback = RolloutEvalCallback(
        num_prompts=2, prompts=str(path), prompt_key="question", answer_key="solution"
    )
    records = callback._held_out(SimpleNamespace(datamodule=None))
    assert [(r["prompt"], r["answer"]) for r in records] == [("0+1=", "1"), ("1+1=", "2")]


def test_evaluation_logs_the_answer_checks_it_gave_up_on_only_once_one_happened(monkeypatch):
    pytest.importorskip("math_verify")
    from unirl_lightning.callbacks import eval as eval_module
    from unirl_lightning.core.timeline import Timeline
    from unirl_lightning.rewards.math_check import AnswerChecker

    slow = "8888** 8** 8"  # parses at once; comparing it with 5 builds 8888**(8**8) in sympy
    checker = AnswerChecker(timeout_seconds=1)
    monkeypatch.setattr(eval_module, "_majority_checker", lambda: checker)
    texts = iter([["5", "5"], [slow, "5"]])
    runtime = SimpleNamespace(eval_reward_timeouts=0, timeline=Timeline(rank=0))

    def evaluate(records, sampling, n, seed):
        return [
            [SimpleNamespace(reward=float(t == "5"), text=t, reward_parts={}) for t in next(texts)]
            for _ in records
        ]

    logged = []
    callback = RolloutEvalCallback(num_prompts=1, num_generations=2, answer_key="answer", pass_k=[])
    callback.strategy = SimpleNamespace(
        runtime=runtime, evaluate=evaluate, weight_version=0, pushed_step=0, rl_steps=0
    )
    callback.sampling = eval_module.SamplingParams()
    callback._records = [{"prompt": "p", "answer": "5"}]
    logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.append(metrics))
    trainer = SimpleNamespace(is_global_zero=True, loggers=[logger], global_step=0)
    first = callback.evaluate(trainer, None)
    assert first["eval/maj@2"] == 1.0 and "eval/reward_timeouts" not in first
    runtime.eval_reward_timeouts = 1  # the workers' scoring gave up once
    second = callback.evaluate(trainer, None)
    # the slow answer votes first (a text is parsed, not compared, against itself); "5" against it
    # and then the reference against it run out: two more, and the tie goes to the slow one: wrong
    assert second["eval/maj@2"] == 0.0 and callback.vote_timeouts == 2
    assert second["eval/reward_timeouts"] == 3.0 and logged[-1] is second
