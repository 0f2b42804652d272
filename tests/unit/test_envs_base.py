"""Pins the environment contract of ``unirl_lightning.envs.base``: reset/step, the turn limit, misuse and crash reporting."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from unirl_lightning.envs import (
    Environment,
    EnvStepError,
    EpisodeStateError,
    StepResult,
    run_episode,
    safe_reset,
    safe_step,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


class CountdownEnv(Environment):
    """Solved by saying the record's answer; otherwise the observation is the number of turns left."""

    def on_reset(self, record):
        self.wrong = 0
        return record["prompt"]

    def on_step(self, assistant_text):
        if assistant_text.strip() == self.record["answer"]:
            return StepResult(None, 1.0, done=True, info={"wrong": self.wrong})
        self.wrong += 1
        return StepResult(str(self.max_turns - self.turn), 0.0, info={"wrong": self.wrong})


class PenaltyAtLimitEnv(CountdownEnv):
    def on_turn_limit(self, last):
        return -1.0


class NoisyEnv(Environment):
    """Observations drawn from ``self.rng``: the seed alone decides them."""

    def on_reset(self, record):
        return f"{record['prompt']} {self.rng.randrange(1000)}"

    def on_step(self, assistant_text):
        return StepResult(str(self.rng.randrange(1000)), self.rng.random())


class CrashingEnv(Environment):
    def __init__(self, max_turns: int = 4, crash_in: str = "step") -> None:
        super().__init__(max_turns)
        self.crash_in = crash_in

    def on_reset(self, record):
        if self.crash_in == "reset":
            raise KeyError("tool_server")
        return "go"

    def on_step(self, assistant_text):
        if self.crash_in == "interrupt":
            raise KeyboardInterrupt
        if self.turn == 2:
            raise ZeroDivisionError("sandbox exploded")
        return StepResult("again")


class ReturnsWrongType(Environment):
    def __init__(self, result=None, max_turns: int = 4) -> None:
        super().__init__(max_turns)
        self.result = result

    def on_reset(self, record):
        return "go"

    def on_step(self, assistant_text):
        return self.result


RECORD = {"prompt": "say 7", "answer": "7"}


def test_reset_returns_the_initial_observation_and_steps_play_until_done_with_turn_and_truncated_info():
    env = CountdownEnv(max_turns=3)
    assert env.reset(RECORD) == "say 7"
    first = env.step("8")
    assert first == StepResult("2", 0.0, False, {"wrong": 1, "turn": 1, "truncated": False})
    assert not env.done and env.turn == 1
    second = env.step(" 7 ")
    assert second == StepResult(None, 1.0, True, {"wrong": 1, "turn": 2, "truncated": False})
    assert env.done and env.total_reward == 1.0


def test_turn_limit_ends_the_episode_with_done_truncated_and_the_step_reward_by_default():
    env = CountdownEnv(max_turns=2)
    env.reset(RECORD)
    assert not env.step("1").done
    last = env.step("2")
    assert last.done and last.info["truncated"] and last.info["turn"] == 2
    assert last.reward == 0.0 and env.total_reward == 0.0


def test_turn_limit_reward_is_the_environments_on_turn_limit():
    env = PenaltyAtLimitEnv(max_turns=1)
    env.reset(RECORD)
    last = env.step("3")
    assert (last.done, last.reward, last.info["truncated"]) == (True, -1.0, True)


def test_solving_on_the_last_allowed_turn_is_not_truncated():
    env = PenaltyAtLimitEnv(max_turns=2)
    env.reset(RECORD)
    env.step("3")
    last = env.step("7")
    assert (last.done, last.reward, last.info["truncated"]) == (True, 1.0, False)


def test_step_before_reset_after_done_and_after_a_crash_raise_episode_state_errors():
    env = CountdownEnv(max_turns=1)
    with pytest.raises(EpisodeStateError, match=r"CountdownEnv.step called before reset\(record\)"):
        env.step("7")
    env.reset(RECORD)
    env.step("7")
    with pytest.raises(EpisodeStateError, match="after the episode ended"):
        env.step("7")
    crashing = CrashingEnv()
    crashing.reset(RECORD)
    crashing.step("a")
    with pytest.raises(ZeroDivisionError):
        crashing.step("b")
    with pytest.raises(EpisodeStateError, match="after a previous step raised"):
        crashing.step("c")


def test_reset_reinitialises_every_per_episode_field_so_an_instance_can_be_reused():
    env = CountdownEnv(max_turns=2)
    env.reset(RECORD)
    env.step("1")
    env.step("7")
    assert env.reset({"prompt": "say 5", "answer": "5"}) == "say 5"
    assert (env.turn, env.done, env.total_reward) == (0, False, 0.0)
    assert env.step("5").info == {"wrong": 0, "turn": 1, "truncated": False}


def test_instances_share_no_state_when_episodes_interleave():
    first, second = CountdownEnv(max_turns=3), CountdownEnv(max_turns=3)
    first.reset(RECORD)
    second.reset({"prompt": "say 5", "answer": "5"})
    first.step("1")
    assert second.step("5").done and not first.done
    assert (first.turn, second.turn) == (1, 1)
    assert first.record["answer"] == "7"


def test_reset_copies_the_record_so_the_callers_dict_is_never_mutated():
    record = dict(RECORD)
    env = CountdownEnv()
    env.reset(record)
    env.record["answer"] = "changed"
    assert record == RECORD


def test_same_record_seed_and_texts_give_the_same_episode_and_another_seed_differs():
    def play(seed):
        env = NoisyEnv(max_turns=3)
        return [env.reset(RECORD, seed=seed)] + [env.step("x") for _ in range(3)]

    assert play(5) == play(5)
    assert play(5) != play(6)


@pytest.mark.parametrize(
    "result, error, message",
    [
        ("text", TypeError, "returned str; expected a StepResult"),
        (StepResult(None, 0.0, done=False), TypeError, "observation=None with done=False"),
        (StepResult("x", float("nan")), ValueError, "returned reward nan; expected a finite float"),
        (StepResult("x", "high"), ValueError, "returned reward 'high'"),
        (StepResult("x", 0.0, done=1), TypeError, "done=1; expected a bool"),
    ],
)
def test_a_hook_breaking_the_contract_raises_naming_the_environment(result, error, message):
    env = ReturnsWrongType(result)
    env.reset(RECORD)
    with pytest.raises(error, match=rf"ReturnsWrongType\.on_step .*{message}"):
        env.step("x")


def test_reset_rejects_a_non_dict_record_a_bad_seed_and_a_malformed_initial_observation():
    env = CountdownEnv()
    with pytest.raises(TypeError, match="needs a prompt record dict, got str"):
        env.reset("say 7")
    with pytest.raises(TypeError, match="seed='1' is invalid"):
        env.reset(RECORD, seed="1")
    with pytest.raises(TypeError, match="expected a prompt str or a non-empty list of chat messages"):
        env.reset({"prompt": [{"role": "user"}], "answer": "7"})


def test_chat_message_initial_observation_is_accepted():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say 7"}]
    assert CountdownEnv().reset({"prompt": messages, "answer": "7"}) == messages


def test_step_needs_decoded_text():
    env = CountdownEnv()
    env.reset(RECORD)
    with pytest.raises(TypeError, match="needs the model's turn as decoded text"):
        env.step([55])


@pytest.mark.parametrize("max_turns", [0, -1, 1.5, True, None])
def test_max_turns_must_be_a_positive_int(max_turns):
    with pytest.raises(ValueError, match=rf"CountdownEnv max_turns={max_turns!r} is invalid"):
        CountdownEnv(max_turns=max_turns)


def test_missing_hooks_raise_not_implemented_naming_the_class():
    class Bare(Environment):
        pass

    with pytest.raises(NotImplementedError, match=r"Bare must implement on_reset\(record\)"):
        Bare().reset(RECORD)


# ---------------------------------------------------------------- crash reporting


def test_safe_step_wraps_a_crash_naming_the_environment_the_turn_the_record_and_the_cause():
    env = CrashingEnv()
    safe_reset(env, {"prompt": "go", "answer": "7"})
    safe_step(env, "a")
    with pytest.raises(EnvStepError) as caught:
        safe_step(env, "b")
    error = caught.value
    assert str(error) == (
        "environment CrashingEnv raised in step (turn 2): ZeroDivisionError: sandbox exploded; "
        "record: {'prompt': 'go', 'answer': '7'}"
    )
    assert isinstance(error.__cause__, ZeroDivisionError)
    assert (error.env_class, error.phase, error.turn) == ("CrashingEnv", "step", 2)
    assert "sandbox exploded" in error.cause_traceback and "on_step" in error.cause_traceback


def test_safe_reset_wraps_a_crash_with_turn_zero():
    with pytest.raises(EnvStepError, match=r"CrashingEnv raised in reset: KeyError: 'tool_server'; record: "):
        safe_reset(CrashingEnv(crash_in="reset"), RECORD)


def test_the_crash_message_truncates_a_long_record():
    record = {"prompt": "x" * 1000, "answer": "7"}
    with pytest.raises(EnvStepError) as caught:
        safe_reset(CrashingEnv(crash_in="reset"), record)
    assert caught.value.record.endswith("...") and len(caught.value.record) == 203
    assert len(str(caught.value)) < 300


def test_env_step_error_survives_a_pickle_round_trip_with_every_field():
    env = CrashingEnv()
    safe_reset(env, RECORD)
    safe_step(env, "a")
    with pytest.raises(EnvStepError) as caught:
        safe_step(env, "b")
    restored = pickle.loads(pickle.dumps(caught.value))
    assert type(restored) is EnvStepError and str(restored) == str(caught.value)
    assert vars(restored) == vars(caught.value)


def test_safe_step_does_not_wrap_caller_misuse_nor_keyboard_interrupt():
    env = CountdownEnv()
    with pytest.raises(EpisodeStateError):
        safe_step(env, "7")
    interrupted = CrashingEnv(crash_in="interrupt")
    safe_reset(interrupted, RECORD)
    with pytest.raises(KeyboardInterrupt):
        safe_step(interrupted, "a")


# ---------------------------------------------------------------- run_episode, picklability, purity


def test_run_episode_plays_a_policy_until_done_and_sums_the_rewards():
    texts = iter(["1", "2", "7"])
    episode = run_episode(CountdownEnv(max_turns=4), RECORD, lambda observation: next(texts))
    assert episode.initial_observation == "say 7"
    assert episode.assistant_texts == ["1", "2", "7"]
    assert [result.observation for result in episode.results] == ["3", "2", None]
    assert episode.total_reward == 1.0 and not episode.truncated


def test_run_episode_stops_at_the_turn_limit():
    episode = run_episode(CountdownEnv(max_turns=2), RECORD, lambda observation: "no")
    assert len(episode.results) == 2 and episode.truncated and episode.total_reward == 0.0


def test_an_environment_pickles_fresh_and_mid_episode_and_continues_identically():
    env = NoisyEnv(max_turns=4)
    assert pickle.loads(pickle.dumps(env)).max_turns == 4
    env.reset(RECORD, seed=3)
    env.step("a")
    clone = pickle.loads(pickle.dumps(env))
    assert clone.step("b") == env.step("b")
    assert clone.turn == env.turn == 2


def test_the_envs_package_imports_neither_torch_nor_ray_in_a_fresh_interpreter():
    probe = (
        "import json, sys\nimport unirl_lightning.envs\n"
        "print(json.dumps(sorted(m for m in ('torch', 'ray', 'numpy') if m in sys.modules)))\n"
    )
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environment.get("PYTHONPATH")]))
    completed = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout.strip().splitlines()[-1]) == []
