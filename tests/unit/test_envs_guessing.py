"""Pins ``unirl_lightning.envs.guessing``: feedback, rewards over scripted episodes, records and splits."""

from __future__ import annotations

import pickle

import pytest

from unirl_lightning.envs import GuessingGameEnv, guessing_records, parse_guess, run_episode
from unirl_lightning.envs.guessing import EXAMPLE_GAME, guessing_prompt
from unirl_lightning.models.causal_lm import CHAR_VOCAB


def game(secret: int, low: int = 0, high: int = 9, syntax: str = "compact") -> dict:
    return {
        "prompt": guessing_prompt(low, high, syntax, state_range=False),
        "secret": secret,
        "low": low,
        "high": high,
    }


class Bisection:
    """The optimal scripted player for the compact syntax: guess the middle of what is left."""

    def __init__(self, low: int = 0, high: int = 9) -> None:
        self.low, self.high, self.last = low, high, None

    def __call__(self, observation) -> str:
        if observation == "+":
            self.low = self.last + 1
        elif observation == "-":
            self.high = self.last - 1
        self.last = (self.low + self.high) // 2
        return str(self.last)


def test_feedback_says_higher_lower_and_correct_ends_the_episode():
    env = GuessingGameEnv(max_turns=4)
    assert env.reset(game(6)) == "?"
    higher = env.step("4")
    assert (higher.observation, higher.reward, higher.done) == ("+", 0.0, False)
    assert higher.info == {
        "guess": 4,
        "feedback": "higher",
        "guesses": 1,
        "invalid_guesses": 0,
        "turn": 1,
        "truncated": False,
    }
    assert env.step("8").observation == "-"
    correct = env.step("6")
    assert (correct.observation, correct.done, correct.info["feedback"]) == (None, True, "correct")


@pytest.mark.parametrize("turns, reward", [(1, 1.0), (2, 0.9), (3, 0.8), (4, 0.7)])
def test_reward_is_found_reward_minus_turn_cost_per_extra_guess(turns, reward):
    env = GuessingGameEnv(max_turns=4, turn_cost=0.1)
    env.reset(game(9))
    for wrong in range(turns - 1):
        env.step(str(wrong))
    assert env.step("9").reward == pytest.approx(reward)
    assert env.total_reward == pytest.approx(reward)


def test_not_finding_the_secret_within_max_turns_scores_zero_and_is_truncated():
    episode = run_episode(GuessingGameEnv(max_turns=3), game(9), lambda observation: "0")
    assert len(episode.results) == 3 and episode.truncated and episode.total_reward == 0.0
    assert [result.observation for result in episode.results] == ["+", "+", "+"]


def test_reward_never_goes_below_zero():
    env = GuessingGameEnv(max_turns=10, turn_cost=0.5)
    env.reset(game(9))
    for wrong in range(5):
        env.step(str(wrong))
    assert env.step("9").reward == 0.0


@pytest.mark.parametrize("secret", range(10))
def test_bisection_finds_every_secret_in_0_to_9_within_four_turns(secret):
    episode = run_episode(GuessingGameEnv(max_turns=4), game(secret), Bisection())
    assert not episode.truncated and episode.results[-1].info["feedback"] == "correct"
    assert episode.total_reward >= 0.7


def test_a_random_policy_earns_less_than_bisection_so_the_reward_rewards_search():
    def mean_return(policy_factory):
        return (
            sum(
                run_episode(GuessingGameEnv(max_turns=4), game(secret), policy_factory()).total_reward
                for secret in range(10)
            )
            / 10
        )

    assert mean_return(lambda: lambda observation: "5") == pytest.approx(0.1)  # found only when secret=5
    assert mean_return(Bisection) > 0.8


def test_invalid_guesses_cost_a_turn_and_get_the_invalid_observation():
    env = GuessingGameEnv(max_turns=4)
    env.reset(game(3))
    for text in ["five", "3 4", ""]:
        result = env.step(text)
        assert (result.observation, result.info["guess"], result.info["feedback"]) == ("?", None, "invalid")
    assert result.info["invalid_guesses"] == 3 and result.info["guesses"] == 0
    assert env.step("3").reward == pytest.approx(0.7)


def test_out_of_range_guesses_still_get_honest_feedback():
    env = GuessingGameEnv()
    env.reset(game(3))
    assert env.step("55").observation == "-"
    assert env.step("-2").observation == "+"


def test_compact_episodes_use_only_the_tiny_vocabulary():
    for secret in range(10):
        env = GuessingGameEnv()
        texts = [env.reset(game(secret))]
        player = Bisection()
        observation = texts[0]
        while not env.done:
            guess = player(observation)
            result = env.step(guess)
            observation = result.observation
            texts += [guess, observation or ""]
        assert set("".join(texts)) <= set(CHAR_VOCAB)


def test_words_syntax_prompts_with_chat_messages_and_reads_the_last_integer():
    env = GuessingGameEnv(max_turns=7, syntax="words")
    prompt = env.reset(game(37, low=1, high=100, syntax="words"))
    assert prompt == [{"role": "user", "content": guessing_prompt(1, 100, "words")}]
    assert env.step("Between 1 and 100, I guess 50.").observation == "lower"
    assert env.step("25").observation == "higher"
    assert env.step("no idea").observation == "Reply with one whole number."
    assert env.step("It is 37!").info["feedback"] == "correct"


def test_example_game_opens_the_chat_with_the_rules_and_a_solved_game_then_plays_the_record():
    env = GuessingGameEnv(max_turns=5, syntax="words", example_game=True)
    messages = env.reset(game(12, low=3, high=17, syntax="words"))
    assert messages[0]["role"] == "system" and "one whole number" in messages[0]["content"]
    assert messages[1:-1] == EXAMPLE_GAME
    assert messages[-1] == {"role": "user", "content": guessing_prompt(3, 17, "words")}
    # the example is a consistent solved game (higher/lower true of its secret, ending in correct)
    guesses = [int(m["content"]) for m in EXAMPLE_GAME if m["role"] == "assistant"]
    replies = [m["content"] for m in EXAMPLE_GAME if m["role"] == "user"][1:]
    secret = guesses[-1]
    assert replies == ["higher" if secret > g else "lower" if secret < g else "correct" for g in guesses]
    # the game played is the record's, not the example's
    assert env.step("5").observation == "higher"
    assert env.step("12").reward == pytest.approx(0.9)


@pytest.mark.parametrize(
    "text, syntax, guess",
    [
        ("7", "compact", 7),
        (" 7 ", "compact", 7),
        ("-3", "compact", -3),
        ("7.", "compact", None),
        ("guess 7", "compact", None),
        ("1" * 19, "compact", None),
        ("I say 4 then 6", "words", 6),
        ("1" * 19, "words", None),
        ("", "words", None),
    ],
)
def test_parse_guess(text, syntax, guess):
    assert parse_guess(text, syntax) == guess


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": "?", "low": 0, "high": 9}, "needs record key 'secret' \\(an int\\); the record has keys"),
        (
            {"prompt": "?", "secret": "7", "low": 0, "high": 9},
            "record 'secret'='7' is invalid; expected an int",
        ),
        (
            {"prompt": "?", "secret": 12, "low": 0, "high": 9},
            "low <= secret <= high, got low=0, secret=12, high=9",
        ),
    ],
)
def test_reset_rejects_a_malformed_record_naming_the_key(record, message):
    with pytest.raises(ValueError, match=message):
        GuessingGameEnv().reset(record)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"syntax": "emoji"}, "syntax='emoji' is invalid"),
        ({"turn_cost": -0.1}, "turn_cost=-0.1 is invalid"),
        ({"found_reward": 0}, "found_reward=0 is invalid"),
        ({"example_game": True}, "example_game=True needs syntax='words'"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GuessingGameEnv(**kwargs)


def test_guessing_env_pickles_mid_episode():
    env = GuessingGameEnv()
    env.reset(game(6))
    env.step("4")
    clone = pickle.loads(pickle.dumps(env))
    assert clone.step("6") == env.step("6")


# ---------------------------------------------------------------- records


def test_guessing_records_are_deterministic_per_seed_and_differ_across_seeds():
    assert guessing_records(30, seed=1) == guessing_records(30, seed=1)
    assert guessing_records(30, seed=1) != guessing_records(30, seed=2)


def test_fixed_range_records_draw_every_secret_with_the_same_prompt_and_refuse_a_heldout_split():
    records = guessing_records(200, seed=0)
    assert {r["secret"] for r in records} == set(range(10))
    assert {(r["prompt"], r["low"], r["high"]) for r in records} == {("?", 0, 9)}
    with pytest.raises(
        ValueError, match="split='heldout' needs vary_range=True: with one fixed range every prompt"
    ):
        guessing_records(1, split="heldout")


def test_varied_range_records_never_share_a_prompt_or_range_between_train_and_heldout():
    train = [r for seed in range(5) for r in guessing_records(300, seed=seed, vary_range=True)]
    heldout = [
        r for seed in range(5) for r in guessing_records(100, seed=seed, split="heldout", vary_range=True)
    ]
    assert heldout and not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    assert not {(r["low"], r["high"]) for r in train} & {(r["low"], r["high"]) for r in heldout}
    for record in train + heldout:
        assert 0 <= record["low"] <= record["secret"] <= record["high"] <= 9
        assert record["high"] - record["low"] >= 1  # min_size=2
        assert record["prompt"] == f"{record['low']},{record['high']}?"


def test_varied_range_words_records_state_the_range_and_keep_the_splits_disjoint():
    train = guessing_records(300, seed=0, low=1, high=100, syntax="words", vary_range=True, min_size=10)
    heldout = guessing_records(100, seed=0, split="heldout", low=1, high=100, syntax="words", vary_range=True)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    assert all(r["high"] - r["low"] >= 9 for r in train)
    assert train[0]["prompt"] == guessing_prompt(train[0]["low"], train[0]["high"], "words")
    assert train[0]["answer"] == str(train[0]["secret"])


def test_generated_records_play_in_the_environment():
    varied = guessing_records(10, seed=0, vary_range=True) + guessing_records(
        10, seed=0, split="heldout", vary_range=True
    )
    for record in guessing_records(10, seed=0) + varied:
        player = Bisection(record["low"], record["high"])
        assert run_episode(GuessingGameEnv(), record, player).total_reward >= 0.7


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"split": "val"}, "split='val' is invalid"),
        ({"vary_range": True, "heldout_percent": 0}, "heldout_percent=0 is invalid"),
        ({"vary_range": True, "min_size": 11}, "needs 1 <= min_size <= high - low \\+ 1 <= 200"),
        ({"vary_range": True, "high": 500}, "needs 1 <= min_size <= high - low \\+ 1 <= 200"),
        (
            {"vary_range": True, "low": 0, "high": 1},
            "no sub-range of \\[0, 1\\] with min_size=2 falls in split .train.",
        ),
        ({"low": 5, "high": 4}, "low=5, high=4 is an empty range"),
        ({"num_prompts": -1}, "num_prompts=-1 is invalid"),
    ],
)
def test_guessing_records_reject_bad_arguments(kwargs, message):
    kwargs = {"num_prompts": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        guessing_records(**kwargs)
