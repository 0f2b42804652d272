"""Pins the worker-side EpisodeCoordinator (envs/coordinator.py) with a scripted engine: one generation
call per turn for every live episode, token layout and mask, abort at a turn boundary with suspend and
resume, environment errors (raise / drop), finalize atomicity."""

from __future__ import annotations

import time

import pytest

from tests.agentic_envs import CountdownEnv, countdown_records
from unirl_lightning.envs import EnvStepError, EpisodeCoordinator, EpisodeRequest, resolve_environment
from unirl_lightning.envs.coordinator import observation_ids
from unirl_lightning.models import build_char_tokenizer
from unirl_lightning.rollout.types import SamplingParams

TOKENIZER = build_char_tokenizer()
FIVE, EOS, COMMA = TOKENIZER.convert_tokens_to_ids(["5", "<eos>", ","])


class ScriptedEngine:
    """Every row answers ``"5<eos>"``; the log-prob of the "5" names the call (-1 - call index)."""

    def __init__(self) -> None:
        self.tokenizer = TOKENIZER
        self.weight_version = 0
        self.calls: list[list[list[int]]] = []

    def generate_ids(self, prompt_ids, sampling, seed=None):
        self.calls.append([list(ids) for ids in prompt_ids])
        logprob = -1.0 - len(self.calls)
        return [([FIVE, EOS], [logprob, -0.25], "stop") for _ in prompt_ids]


def make(step_sleep_s: float = 0.0, on_env_error: str = "raise"):
    engine = ScriptedEngine()
    spec = resolve_environment(CountdownEnv, {"step_sleep_s": step_sleep_s})
    return engine, EpisodeCoordinator(engine, spec, SamplingParams(max_new_tokens=2), on_env_error)


def requests_for(records, n: int = 2) -> list[EpisodeRequest]:
    return [EpisodeRequest(f"g{i}/{k}", r, seed=i * n + k) for i, r in enumerate(records) for k in range(n)]


def drain(coordinator, timeout_s: float = 20.0) -> list:
    samples, deadline = [], time.monotonic() + timeout_s
    while not coordinator.finalize_if_drained():
        samples += coordinator.poll()
        assert time.monotonic() < deadline, "the drive did not end"
        time.sleep(0.002)
    return samples


def test_every_live_episode_shares_one_generation_call_per_turn_and_turns_are_appended_never_retokenized():
    engine, coordinator = make()
    coordinator.submit(requests_for(countdown_records([1, 3])))
    samples = {s.sample_id: s for s in drain(coordinator)}
    assert [len(call) for call in engine.calls] == [4, 2, 2]  # all live episodes in each turn's call
    long = samples["g1/0"]
    prompt = TOKENIZER("3?", add_special_tokens=False)["input_ids"]
    assert long.prompt_ids == prompt
    assert long.completion_ids == [FIVE, EOS, COMMA, FIVE, EOS, COMMA, FIVE, EOS]
    assert long.loss_mask == [1, 1, 0, 1, 1, 0, 1, 1]  # model tokens 1, environment tokens 0
    assert long.logprobs == [-2.0, -0.25, 0.0, -3.0, -0.25, 0.0, -4.0, -0.25]  # behaviour log-prob per turn
    # each turn's context is the previous context plus exactly the sampled and observed ids
    assert engine.calls[1][0] == prompt + [FIVE, EOS, COMMA]
    assert engine.calls[2][0] == prompt + [FIVE, EOS, COMMA, FIVE, EOS, COMMA]
    assert (long.num_turns, long.tool_calls, long.turn_versions, long.reward) == (
        3,
        3,
        [0, 0, 0],
        pytest.approx(0.3),
    )
    assert samples["g0/1"].num_turns == 1 and samples["g0/1"].loss_mask == [1, 1]


def test_finalize_if_drained_stays_false_until_every_finished_episode_was_polled():
    _, coordinator = make()
    coordinator.submit(requests_for(countdown_records([1]), n=1))
    deadline = time.monotonic() + 10
    while coordinator._running:  # the drive ends on its own; nothing polled yet
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert coordinator.finalize_if_drained() is False
    assert [s.sample_id for s in coordinator.poll()] == ["g0/0"]
    assert coordinator.finalize_if_drained() is True
    assert coordinator.drive_live is False


def test_abort_stops_at_a_turn_boundary_suspends_live_episodes_and_a_resubmit_resumes_them_under_new_weights():
    engine, coordinator = make(step_sleep_s=0.02)
    records = countdown_records([1, 8])
    coordinator.submit(requests_for(records))
    finished, deadline = [], time.monotonic() + 10
    while len(finished) < 2:  # the short group finishes after one turn; the long one is still live
        finished += coordinator.poll()
        assert time.monotonic() < deadline
        time.sleep(0.002)
    finished += coordinator.abort()
    assert sorted(s.sample_id for s in finished) == ["g0/0", "g0/1"]
    assert sorted(coordinator.suspended()) == ["g1/0", "g1/1"]
    assert coordinator.drive_live is False
    turns_before = len(engine.calls)
    context_before = engine.calls[-1][-1]
    engine.weight_version = 1  # a sync happened between the drives
    coordinator.submit([EpisodeRequest(sid, records[1]) for sid in coordinator.suspended()])
    resumed = drain(coordinator)
    assert sorted(s.sample_id for s in resumed) == ["g1/0", "g1/1"]
    for sample in resumed:
        assert sample.num_turns == 8 and len(sample.turn_versions) == 8
        switch = sample.turn_versions.index(1)
        assert 0 < switch < 8 and sample.turn_versions == [0] * switch + [1] * (8 - switch)
        assert sample.loss_mask == [1, 1, 0] * 7 + [1, 1]  # whole turns only: never a split turn
    # the first call after the resume continues the very context the suspended episode had reached
    first_resumed = engine.calls[turns_before]
    assert any(ctx[: len(context_before)] == context_before for ctx in first_resumed)
    assert coordinator.suspended() == [] and coordinator.discarded == 0


def test_a_submit_that_does_not_name_a_suspended_episode_discards_it():
    _, coordinator = make(step_sleep_s=0.02)
    coordinator.submit(requests_for(countdown_records([20]), n=1))
    time.sleep(0.05)
    coordinator.abort()
    assert coordinator.suspended() == ["g0/0"]
    coordinator.submit([EpisodeRequest("g1/0", countdown_records([1])[0])])
    assert [s.sample_id for s in drain(coordinator)] == ["g1/0"]
    assert coordinator.discarded == 1 and coordinator.suspended() == []


def test_env_error_raise_stops_the_drive_and_is_raised_naming_the_environment_and_the_record():
    _, coordinator = make(on_env_error="raise")
    records = countdown_records([3], crash_at=2)
    coordinator.submit(requests_for(records, n=1))
    deadline = time.monotonic() + 10
    with pytest.raises(EnvStepError) as caught:
        while True:
            coordinator.poll()
            assert time.monotonic() < deadline
            time.sleep(0.002)
    message = str(caught.value)
    assert "CountdownEnv" in message and "turn 2" in message and "'3?'" in message
    assert "tool backend unavailable" in message
    assert coordinator.finalize_if_drained() is False  # the error is not lost by ending the drive
    with pytest.raises(EnvStepError):
        coordinator.abort()
    assert coordinator.drive_live is False
    coordinator.submit(requests_for(countdown_records([1]), n=1))  # a new drive may start
    assert len(drain(coordinator)) == 1


def test_env_error_drop_fails_only_that_episode_which_still_completes_its_group():
    _, coordinator = make(on_env_error="drop")
    records = countdown_records([3]) + countdown_records([3], crash_at=2)
    coordinator.submit(requests_for(records))
    samples = {s.sample_id: s for s in drain(coordinator)}
    assert sorted(samples) == ["g0/0", "g0/1", "g1/0", "g1/1"]
    assert samples["g0/0"].env_error is None and samples["g0/0"].num_turns == 3
    failed = samples["g1/0"]
    assert "CountdownEnv" in failed.env_error and "'3?'" in failed.env_error
    assert failed.reward == 0.0 and failed.num_turns == 2


def test_an_engine_without_generate_ids_is_refused_naming_the_engine():
    class BatchOnlyEngine:
        tokenizer = TOKENIZER
        weight_version = 0

    with pytest.raises(NotImplementedError, match="BatchOnlyEngine does not implement it yet"):
        EpisodeCoordinator(BatchOnlyEngine(), resolve_environment(CountdownEnv), SamplingParams())


def test_chat_observations_append_only_what_the_template_adds_for_a_new_message():
    class ChatTokenizer:
        chat_template = "fake"

        def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
            text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
            return text + ("<assistant>" if add_generation_prompt else "")

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(ch) for ch in text]}

    ids = observation_ids(ChatTokenizer(), "42", chat_role="tool")
    assert "".join(map(chr, ids)) == "<tool>42</><assistant>"
    assert "".join(map(chr, observation_ids(ChatTokenizer(), "42", chat_role=None))) == "42"
