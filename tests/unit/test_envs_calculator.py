"""Pins ``unirl_lightning.envs.calculator``: the safe evaluator, turn parsing, math-verify scoring, records."""

from __future__ import annotations

import pickle
from fractions import Fraction

import pytest

from unirl_lightning.envs import (
    CalculatorEnv,
    CalculatorError,
    EnvStepError,
    calculator_records,
    parse_calculator_turn,
    run_episode,
    safe_eval,
    safe_reset,
    safe_step,
)
from unirl_lightning.envs.calculator import CALCULATOR_INSTRUCTIONS, format_number
from unirl_lightning.models.causal_lm import CHAR_VOCAB
from unirl_lightning.rewards import ExactMatchReward

RECORD = {"prompt": "What is 37*12+5?", "answer": "449"}
COMPACT_RECORD = {"prompt": "37*12+5?", "answer": "449"}


# ---------------------------------------------------------------- safe_eval


@pytest.mark.parametrize(
    "expression, value",
    [
        ("12*7+3", 87),
        ("2+3*4", 14),
        ("(2+3)*4", 20),
        ("-5+2", -3),
        ("-(2+3)", -5),
        ("+4", 4),
        ("--4", 4),
        ("7/2", Fraction(7, 2)),
        ("0.1+0.2", Fraction(3, 10)),
        (" 37 * 12 ", 444),
        ("1/3*3", 1),
        ("((((1))))", 1),
    ],
)
def test_safe_eval_computes_plain_arithmetic_exactly(expression, value):
    assert safe_eval(expression) == value


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').system('ls')", "are not allowed"),
        ("x+1", "'x' are not allowed"),
        ("abs(-1)", "are not allowed"),
        ("1e400", "'e' are not allowed"),
        ("1_000", "'_' are not allowed"),
        ("2**10", "operator '\\*\\*' is not allowed"),
        ("9**9**9", "operator '\\*\\*' is not allowed"),
        ("7//2", "operator '//' is not allowed"),
        ("7%2", "'%' are not allowed"),
        ("1<2", "'<' are not allowed"),
        ("(1)(2)", "Call is not allowed"),
        ("(1,2)", "',' are not allowed"),
        ("1 2", "not a well-formed arithmetic expression"),
        ("(1+2", "not a well-formed arithmetic expression"),
        ("", "empty expression"),
        ("   ", "empty expression"),
        ("1/0", "division by zero"),
        ("1/(2-2)", "division by zero"),
        ("99999999*99999999", "exceeds the calculator's limit"),
        ("1234567890123456789", "exceeds the calculator's limit"),
        ("1" + "+1" * 60, "at most 100 are allowed"),
        ("(" * 200 + "1" + ")" * 200, "at most 100 are allowed"),
    ],
)
def test_safe_eval_refuses_anything_but_bounded_arithmetic_with_a_calculator_error(expression, message):
    with pytest.raises(CalculatorError, match=message):
        safe_eval(expression)


def test_safe_eval_refuses_a_non_string():
    with pytest.raises(CalculatorError, match="must be a str, got int"):
        safe_eval(12)


def test_calculator_error_is_a_value_error_so_callers_can_catch_either():
    assert issubclass(CalculatorError, ValueError)


@pytest.mark.parametrize(
    "value, text",
    [
        (Fraction(87), "87"),
        (Fraction(-3), "-3"),
        (Fraction(1, 3), "0.333333"),
        (Fraction(7, 2), "3.5"),
        (Fraction(-1, 10**9), "0"),
    ],
)
def test_format_number_prints_integers_as_is_and_rounds_other_values(value, text):
    assert format_number(value) == text


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    "text, syntax, parsed",
    [
        ("first <calc>37*12</calc> then", "xml", ("call", "37*12")),
        ("<calc> 37*12 </calc><calc>1+1</calc>", "xml", ("call", "37*12")),
        ("<calc>37*12", "xml", ("call", "37*12")),  # closing tag cut off by a stop string
        ("so <answer>449</answer>", "xml", ("answer", "449")),
        ("<calc>1+1</calc> <answer>2</answer>", "xml", ("answer", "2")),  # an answer wins
        ("<answer>\\boxed{449}", "xml", ("answer", "\\boxed{449}")),
        ("the answer is 449", "xml", ("none", "")),
        ("37*12=", "compact", ("call", "37*12")),
        (" 37*12+5 = ", "compact", ("call", "37*12+5")),
        ("449", "compact", ("answer", "449")),
        ("-3.5", "compact", ("answer", "-3.5")),
        ("37*12", "compact", ("none", "")),
        ("", "compact", ("none", "")),
    ],
)
def test_parse_calculator_turn_finds_the_answer_or_the_first_call(text, syntax, parsed):
    assert parse_calculator_turn(text, syntax) == parsed


# ---------------------------------------------------------------- episodes


def test_xml_episode_prompts_with_chat_messages_answers_a_call_and_scores_the_answer_with_math_verify():
    env = CalculatorEnv(max_turns=3)
    assert env.reset(RECORD) == [
        {"role": "system", "content": CALCULATOR_INSTRUCTIONS},
        {"role": "user", "content": "What is 37*12+5?"},
    ]
    call = env.step("I compute <calc>37*12+5</calc>")
    assert (call.observation, call.reward, call.done) == ("<result>449</result>", 0.0, False)
    assert call.info["tool_calls"] == 1 and call.info["result"] == "449"
    answer = env.step("<answer>449</answer>")
    assert (answer.observation, answer.reward, answer.done) == (None, 1.0, True)
    assert answer.info == {
        "tool_calls": 1,
        "tool_errors": 0,
        "format_errors": 0,
        "answer": "449",
        "turn": 2,
        "truncated": False,
    }


@pytest.mark.parametrize(
    "answer, reward",
    [("449", 1.0), ("\\boxed{449}", 1.0), ("449.0", 1.0), ("450", 0.0), ("", 0.0), ("four hundred", 0.0)],
)
def test_the_final_answer_is_scored_by_math_verify_against_the_records_answer(answer, reward):
    env = CalculatorEnv()
    env.reset(RECORD)
    result = env.step(f"<answer>{answer}</answer>")
    assert result.done and result.reward == reward


def test_malformed_calls_and_turns_get_error_observations_and_are_counted_never_raised():
    env = CalculatorEnv(max_turns=5)
    env.reset(RECORD)
    assert env.step("<calc>__import__('os')</calc>").observation.startswith("<error>character(s)")
    assert env.step("<calc>1/0</calc>").observation == "<error>division by zero</error>"
    no_call = env.step("hmm, 449?")
    assert no_call.observation.startswith("<error>write <calc>expression</calc>")
    assert not no_call.done
    assert no_call.info | {} == {
        "tool_calls": 2,
        "tool_errors": 2,
        "format_errors": 1,
        "turn": 3,
        "truncated": False,
    }


def test_no_answer_within_max_turns_ends_truncated_with_reward_zero():
    env = CalculatorEnv(max_turns=2)
    env.reset(RECORD)
    env.step("<calc>37*12</calc>")
    last = env.step("<calc>444+5</calc>")
    assert (last.done, last.reward, last.info["truncated"], last.info["tool_calls"]) == (True, 0.0, True, 2)


def test_compact_episode_uses_only_the_tiny_vocabulary_and_is_solved_by_copying():
    records = calculator_records(20, seed=1, syntax="compact")
    for record in records:
        env = CalculatorEnv(max_turns=2, syntax="compact")
        prompt = env.reset(record)
        expression = prompt.removesuffix("?")
        episode_texts = [prompt, f"{expression}="]
        result = env.step(f"{expression}=")
        episode_texts.append(result.observation)
        assert result.observation == f"{record['answer']},"
        final = env.step(record["answer"])
        episode_texts.append(record["answer"])
        assert final.done and final.reward == 1.0 and not final.info["truncated"]
        assert set("".join(episode_texts)) <= set(CHAR_VOCAB)


def test_compact_errors_are_a_short_observation_in_the_tiny_vocabulary():
    env = CalculatorEnv(syntax="compact")
    env.reset(COMPACT_RECORD)
    assert env.step("1/0=").observation == "?,"
    assert env.step("abc").observation == "?,"
    assert env.step("12*").info["format_errors"] == 2


def test_a_custom_reward_replaces_math_verify():
    env = CalculatorEnv(reward=ExactMatchReward())
    env.reset(RECORD)
    assert env.step("<answer>449.0</answer>").reward == 0.0


def test_reset_needs_the_prompt_and_answer_keys():
    with pytest.raises(
        ValueError, match="CalculatorEnv needs record key 'answer'; the record has keys \\['prompt'\\]"
    ):
        CalculatorEnv().reset({"prompt": "What is 1+1?"})


def test_a_reward_that_raises_is_reported_as_an_env_step_error_by_safe_step():
    env = CalculatorEnv(answer_key="answer")
    safe_reset(env, RECORD)
    env.record.pop("answer")  # the reward will miss its key
    with pytest.raises(
        EnvStepError, match=r"CalculatorEnv raised in step \(turn 1\): RewardError: .*'answer'"
    ):
        safe_step(env, "<answer>449</answer>")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"syntax": "json"}, "syntax='json' is invalid; expected one of \\('xml', 'compact'\\)"),
        ({"max_expression_chars": 0}, "max_expression_chars=0 is invalid"),
        ({"decimals": -1}, "decimals=-1 is invalid"),
        ({"max_turns": 0}, "max_turns=0 is invalid"),
    ],
)
def test_constructor_rejects_bad_arguments_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CalculatorEnv(**kwargs)


def test_calculator_env_pickles_mid_episode():
    env = CalculatorEnv(max_turns=3)
    env.reset(RECORD)
    env.step("<calc>37*12</calc>")
    clone = pickle.loads(pickle.dumps(env))
    assert clone.step("<answer>449</answer>") == env.step("<answer>449</answer>")


def test_run_episode_with_a_scripted_tool_user_solves_every_generated_problem():
    def tool_user(observation):
        if isinstance(observation, list):  # the prompt: compute the whole expression
            return (
                "<calc>" + observation[-1]["content"].removeprefix("What is ").removesuffix("?") + "</calc>"
            )
        return "<answer>" + observation.removeprefix("<result>").removesuffix("</result>") + "</answer>"

    for record in calculator_records(10, seed=2):
        episode = run_episode(CalculatorEnv(max_turns=2), record, tool_user)
        assert episode.total_reward == 1.0 and episode.results[-1].info["tool_calls"] == 1


# ---------------------------------------------------------------- records


def test_calculator_records_are_deterministic_per_seed_and_differ_across_seeds():
    assert calculator_records(50, seed=3) == calculator_records(50, seed=3)
    assert calculator_records(50, seed=3) != calculator_records(50, seed=4)


def test_calculator_records_never_overlap_between_train_and_heldout_whatever_the_seeds():
    train = {r["expression"] for seed in range(3) for r in calculator_records(2000, seed=seed)}
    heldout = {
        r["expression"] for seed in range(3) for r in calculator_records(300, seed=seed, split="heldout")
    }
    assert heldout and not train & heldout


def test_calculator_records_need_the_tool_and_have_correct_answers():
    for record in calculator_records(100, seed=0, digits=2):
        a, rest = record["expression"].split("*")
        assert len(a) == 2 and len(rest) >= 3  # two two-digit factors, then +c or -c
        assert safe_eval(record["expression"]) == int(record["answer"])
        assert record["prompt"] == f"What is {record['expression']}?" and record["task"] == "calculator"


def test_one_digit_records_have_short_answers_and_still_hold_some_out():
    train = calculator_records(3000, seed=0, syntax="compact", digits=1)
    heldout = calculator_records(200, seed=0, syntax="compact", digits=1, split="heldout")
    for record in train + heldout:
        a, b_c = record["expression"].split("*")
        assert len(a) == 1 and len(b_c) == 3  # a*b+c with one-digit a, b and c
        assert (
            safe_eval(record["expression"]) == int(record["answer"])
            and len(record["answer"].lstrip("-")) <= 2
        )
    expressions = {r["expression"] for r in train}
    assert 1000 < len(expressions) < 1458 and not expressions & {r["expression"] for r in heldout}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"split": "test"}, "split='test' is invalid; expected one of \\('train', 'heldout'\\)"),
        ({"digits": 0}, "digits=0 is invalid"),
        ({"heldout_percent": 0}, "heldout_percent=0 is invalid"),
        ({"syntax": "json"}, "syntax='json' is invalid"),
    ],
)
def test_calculator_records_reject_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        calculator_records(1, **kwargs)


# ---------------------------------------------------------------- shaping for small models


COMPACT = {"prompt": "37*12+5?", "answer": "449", "expression": "37*12+5"}


def test_the_equals_key_evaluates_the_question_and_is_off_by_default():
    keyed = CalculatorEnv(max_turns=2, syntax="compact", equals_key=True)
    keyed.reset(COMPACT)
    call = keyed.step("=")
    assert (call.observation, call.info["tool_calls"], call.info["expression"]) == ("449,", 1, "37*12+5")
    plain = CalculatorEnv(max_turns=2, syntax="compact")
    plain.reset(COMPACT)
    assert plain.step("=").observation == "?,"  # an empty expression is refused


def test_the_equals_key_needs_the_compact_syntax_and_the_records_expression():
    with pytest.raises(ValueError, match="equals_key=True needs syntax='compact'"):
        CalculatorEnv(syntax="xml", equals_key=True)
    env = CalculatorEnv(syntax="compact", equals_key=True)
    with pytest.raises(ValueError, match="needs record key 'expression'"):
        env.reset({"prompt": "37*12+5?", "answer": "449"})


@pytest.mark.parametrize(
    "turns, reward",
    [
        (["=", "449"], 1.0),  # exact after a call
        (["=", "440"], 0.5 * 2 / 3),  # two of three digits, after a successful call
        (["440"], 0.0),  # no call: only an exact answer scores
        (["1/0=", "440"], 0.0),  # a refused call is not a successful one
        (["449=", "440"], 0.5 * 2 / 3),  # the expression typed out: its result is the answer
        (["11=", "441"], 0.0),  # a call that did not return the answer earns nothing (the constant-call game)
        (["11=", "=", "440"], 0.5 * 2 / 3),  # the answer was in the context by the last turn
    ],
)
def test_tool_credit_pays_digits_only_after_a_tool_call_that_returned_the_answer(turns, reward):
    env = CalculatorEnv(max_turns=3, syntax="compact", equals_key=True, tool_credit=True)
    env.reset(COMPACT)
    for text in turns:
        result = env.step(text)
    assert result.done and result.reward == pytest.approx(reward)


@pytest.mark.parametrize(
    "turns, reward",
    [
        (["=", "9"], 0.1),  # a useful call, then a wrong answer: the floor
        (["=", "440"], 0.5 * 2 / 3),  # more digit credit than the floor
        (["=", "449"], 1.0),
        (["11=", "9"], 0.0),  # the call did not return the answer
        (["9"], 0.0),  # no call
        (["=", "="], 0.0),  # no answer
    ],
)
def test_call_credit_is_the_floor_of_an_answer_after_a_useful_call(turns, reward):
    env = CalculatorEnv(max_turns=2, syntax="compact", equals_key=True, tool_credit=True, call_credit=0.1)
    env.reset(COMPACT)
    for text in turns:
        result = env.step(text)
        if result.done:
            break
    assert result.done and result.reward == pytest.approx(reward)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"call_credit": 0.1}, "call_credit needs tool_credit=True"),
        (
            {"call_credit": 0.7, "tool_credit": True},
            "call_credit=0.7 is invalid; expected a number in \\[0, 0.5\\]",
        ),
    ],
)
def test_call_credit_is_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CalculatorEnv(syntax="compact", **kwargs)


def test_digit_credit_is_half_the_matching_positions_over_the_longer_text():
    from unirl_lightning.envs import digit_credit

    assert digit_credit("449", COMPACT) == 1.0
    assert digit_credit("4490", COMPACT) == pytest.approx(
        0.5 * 3 / 4
    )  # math-verify refuses it; 3 of 4 positions
    assert digit_credit("9", COMPACT) == 0.0
