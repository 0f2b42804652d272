"""Pins unirl_lightning.rewards: scores on real math_verify, the score_batch checks, picklability."""

from __future__ import annotations

import math
import pickle
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from unirl_lightning.rewards import (
    CallableReward,
    CombinedReward,
    ExactMatchReward,
    FormatReward,
    MathVerifyReward,
    Reward,
    RewardError,
    score_batch,
)

MATH_COMPLETIONS = ["The answer is \\boxed{7}", "8", "0.5"]
MATH_RECORDS = [
    {"prompt": "3+4=", "answer": "7"},
    {"prompt": "3+4=", "answer": "7"},
    {"prompt": "half?", "answer": "1/2"},
]


class Exploding(Reward):
    name = "exploding"

    def __call__(self, completions, records):
        raise ZeroDivisionError("boom")


class Constant(Reward):
    def __init__(self, values: list) -> None:
        self.values = values
        self.name = "constant"

    def __call__(self, completions, records):
        return list(self.values)


@pytest.fixture
def length_module(tmp_path, monkeypatch):
    (tmp_path / "my_length_reward.py").write_text(
        textwrap.dedent(
            """
            def length(completion, record):
                return float(len(completion))

            class Scorers:
                @staticmethod
                def has_answer(completion, record):
                    return float(record["answer"] in completion)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_length_reward"


# ---------------------------------------------------------------- MathVerifyReward


def test_math_verify_scores_boxed_match_one_wrong_zero_and_equal_fraction_one():
    assert MathVerifyReward()(MATH_COMPLETIONS, MATH_RECORDS) == [1.0, 0.0, 1.0]


def test_math_verify_uses_configured_correct_incorrect_values_and_answer_key():
    reward = MathVerifyReward(answer_key="solution", correct=2.0, incorrect=-1.0)
    records = [{"prompt": "p", "solution": "7"}, {"prompt": "p", "solution": "7"}]
    assert reward(["7", "8"], records) == [2.0, -1.0]


def test_math_verify_completion_without_answer_scores_incorrect():
    assert MathVerifyReward(incorrect=-0.5)([""], [{"prompt": "p", "answer": "7"}]) == [-0.5]


def test_math_verify_gives_same_scores_off_the_main_thread():
    # math_verify's default timeouts use signal.alarm, which raises off the main thread.
    reward = MathVerifyReward()
    with ThreadPoolExecutor(max_workers=1) as pool:
        scores = pool.submit(score_batch, reward, MATH_COMPLETIONS, MATH_RECORDS).result()
    assert scores == [1.0, 0.0, 1.0]


def test_math_verify_rejects_negative_timeout():
    with pytest.raises(ValueError, match=r"timeout_seconds=-1 .*None or an int >= 0"):
        MathVerifyReward(timeout_seconds=-1)


def test_math_verify_missing_answer_key_names_key_through_score_batch():
    with pytest.raises(RewardError, match=r"'math_verify'.*'3\+4='.*'answer'") as info:
        score_batch(MathVerifyReward(), ["7"], [{"prompt": "3+4=", "gold": "7"}])
    assert isinstance(info.value.__cause__, KeyError)


# ---------------------------------------------------------------- simple rewards


def test_exact_match_strips_whitespace_by_default_and_not_when_disabled():
    records = [{"answer": " 7"}, {"answer": "7"}, {"answer": 7}]
    assert ExactMatchReward()(["7\n", "8", "7"], records) == [1.0, 0.0, 1.0]
    assert ExactMatchReward(strip=False)(["7\n", "7", "7"], records) == [0.0, 1.0, 1.0]


def test_format_reward_is_partial_search_unless_fullmatch():
    completions = ["x <a>1</a> y", "<a>1</a>", "no tags"]
    records = [{}] * 3
    assert FormatReward(r"<a>\d</a>", score=0.5)(completions, records) == [0.5, 0.5, 0.0]
    assert FormatReward(r"<a>\d</a>", fullmatch=True)(completions, records) == [0.0, 1.0, 0.0]


def test_format_reward_invalid_pattern_names_pattern():
    with pytest.raises(ValueError, match=r"pattern='\(unclosed' is not a valid regular expression"):
        FormatReward("(unclosed")


def test_callable_reward_resolves_colon_and_dotted_paths(length_module):
    records = [{"prompt": "p", "answer": "12"}] * 2
    assert CallableReward(f"{length_module}:length")(["abc", ""], records) == [3.0, 0.0]
    assert CallableReward(f"{length_module}.length")(["ab", "x"], records) == [2.0, 1.0]
    assert CallableReward(f"{length_module}:Scorers.has_answer")(["a12", "1"], records) == [1.0, 0.0]


def test_callable_reward_name_defaults_to_path_or_function_name(length_module):
    assert CallableReward(f"{length_module}:length").name == f"{length_module}:length"
    assert CallableReward(len).name == "len"
    assert CallableReward(len, name="short").name == "short"


def test_callable_reward_pickles_as_its_path_after_use(length_module):
    reward = CallableReward(f"{length_module}:length")
    assert reward(["abcd"], [{}]) == [4.0]
    restored = pickle.loads(pickle.dumps(reward))
    assert restored.fn == f"{length_module}:length"
    assert restored.__dict__["_resolved"] is None  # the function object itself is not shipped
    assert restored(["abcd"], [{}]) == [4.0]


def test_callable_reward_bad_paths_raise_naming_the_path(length_module):
    with pytest.raises(
        ImportError, match=r"reward='no_such_module_xyz:f': no module named 'no_such_module_xyz'"
    ):
        CallableReward("no_such_module_xyz:f")(["a"], [{}])
    with pytest.raises(ImportError, match=rf"module '{length_module}' has no attribute 'missing'"):
        CallableReward(f"{length_module}:missing")(["a"], [{}])
    with pytest.raises(
        ValueError, match=r"reward='nodots' is not a function path; expected 'package.module:function'"
    ):
        CallableReward("nodots")(["a"], [{}])
    with pytest.raises(TypeError, match=r"fn must be a callable or an import path string, got 3"):
        CallableReward(3)


def test_combined_reward_is_weighted_sum_and_default_weights_are_one():
    records = [{"answer": "7"}, {"answer": "7"}, {"answer": "7"}]
    completions = ["7", "77", "x"]
    parts = [ExactMatchReward(), FormatReward(r"^\d+$")]
    assert CombinedReward(parts, weights=[2.0, 0.5])(completions, records) == [2.5, 0.5, 0.0]
    assert CombinedReward(parts)(completions, records) == [2.0, 1.0, 0.0]
    assert CombinedReward(parts).name == "combined(exact_match,format)"


def test_combined_reward_weight_count_mismatch_names_counts():
    with pytest.raises(ValueError, match=r"weights=\[1.0\] has 1 entries; expected 2"):
        CombinedReward([ExactMatchReward(), FormatReward("x")], weights=[1.0])
    with pytest.raises(ValueError, match=r"rewards=\[\] is empty"):
        CombinedReward([])


def test_combined_reward_failing_component_error_names_component():
    with pytest.raises(RewardError, match=r"reward 'exploding'"):
        score_batch(
            CombinedReward([ExactMatchReward(), Exploding()]), ["7"], [{"prompt": "q", "answer": "7"}]
        )


COMBINED_REWARD_YAML = r"""
reward:
  class_path: unirl_lightning.rewards.CombinedReward
  init_args:
    rewards:
      - class_path: unirl_lightning.rewards.MathVerifyReward
      - class_path: unirl_lightning.rewards.FormatReward
        init_args:
          pattern: \\boxed\{.+\}
    weights: [1.0, 0.1]
"""


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_combined_math_verify_and_boxed_format_reward_builds_from_class_path_yaml():
    # The shape LightningCLI parses for GRPOModule(reward: Reward | str); in YAML the plain scalar
    # keeps both backslashes, so the regex matches a literal "\boxed{...}".
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--reward", type=Reward | str)
    reward = parser.instantiate_classes(parser.parse_string(COMBINED_REWARD_YAML)).reward
    assert isinstance(reward, CombinedReward) and reward.weights == [1.0, 0.1]
    assert [type(part) for part in reward.rewards] == [MathVerifyReward, FormatReward]
    assert reward.rewards[1].pattern == r"\\boxed\{.+\}"
    completions = ["so \\boxed{7}", "7", "\\boxed{8}", "boxed{7}"]
    scores = reward(completions, [{"prompt": "3+4=", "answer": "7"}] * 4)
    # boxed and right; right but unboxed; boxed but wrong; no backslash: neither boxed nor parsed
    assert scores == pytest.approx([1.1, 1.0, 0.1, 0.0])


def test_all_rewards_survive_pickle_with_same_scores():
    rewards = [
        MathVerifyReward(),
        ExactMatchReward(),
        FormatReward(r"\d"),
        CallableReward("operator:is_not"),
        CombinedReward([ExactMatchReward(), "operator:is_not"], weights=[1.0, 0.25]),
    ]
    completions, records = ["7", "x"], [{"prompt": "p", "answer": "7"}] * 2
    for reward in rewards:
        assert pickle.loads(pickle.dumps(reward))(completions, records) == reward(completions, records)


# ---------------------------------------------------------------- score_batch


def test_score_batch_wraps_raising_reward_naming_reward_and_prompt():
    records = [{"prompt": "What is 2+2?", "answer": "4"}]
    with pytest.raises(RewardError) as info:
        score_batch(Exploding(), ["4"], records)
    message = str(info.value)
    assert "'exploding'" in message and "What is 2+2?" in message and "ZeroDivisionError: boom" in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert isinstance(info.value, RuntimeError)


def test_score_batch_truncates_long_prompt_to_200_chars():
    with pytest.raises(RewardError) as info:
        score_batch(Exploding(), ["x"], [{"prompt": "a" * 199 + "b" + "c" * 500}])
    message = str(info.value)
    assert "a" * 199 + "b..." in message and "c" not in message.split("b...")[1].split("raised")[0]


def test_score_batch_rejects_wrong_length_naming_seen_and_expected():
    with pytest.raises(RewardError, match=r"'constant'.*returned 1 scores; expected 2"):
        score_batch(Constant([1.0]), ["a", "b"], [{"prompt": "p"}] * 2)


@pytest.mark.parametrize("bad", [math.nan, math.inf, None, "high"])
def test_score_batch_rejects_non_finite_or_non_numeric_score(bad):
    with pytest.raises(
        RewardError, match=rf"'constant'.*returned score {bad!r} at index 1; expected a finite float"
    ):
        score_batch(Constant([0.0, bad]), ["a", "b"], [{"prompt": "p"}] * 2)


def test_score_batch_returns_python_floats():
    scores = score_batch(Constant([1, True]), ["a", "b"], [{"prompt": "p"}] * 2)
    assert scores == [1.0, 1.0] and all(type(score) is float for score in scores)


def test_score_batch_resolves_string_reward_as_per_sample_callable(length_module):
    assert score_batch(f"{length_module}:length", ["abc"], [{"prompt": "p"}]) == [3.0]


def test_score_batch_rejects_completion_record_length_mismatch():
    with pytest.raises(ValueError, match=r"got 2 completions but 1 records"):
        score_batch(ExactMatchReward(), ["a", "b"], [{"prompt": "p", "answer": "a"}])


def test_score_batch_empty_batch_gives_empty_scores():
    assert score_batch(ExactMatchReward(), [], []) == []
