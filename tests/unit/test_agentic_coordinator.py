"""Pins the worker-side EpisodeCoordinator (envs/coordinator.py) with a scripted engine: one generation
call per turn for every live episode, token layout and mask, abort at a turn boundary with suspend and
resume, environment errors (raise / drop), finalize atomicity, truncated chat turns (close / end),
the context budget, and the per-episode turn seeds."""

from __future__ import annotations

import time

import pytest

from tests.agentic_envs import CountdownEnv, countdown_records
from tests.unit.real_model import needs_smollm2, smollm2_tokenizer
from unirl_lightning.envs import EnvStepError, EpisodeCoordinator, EpisodeRequest, resolve_environment
from unirl_lightning.envs.coordinator import (
    EpisodeSettings,
    call_seed,
    observation_ids,
    turn_closing_ids,
    turn_seed,
)
from unirl_lightning.models.causal_lm import build_char_tokenizer
from unirl_lightning.rollout.records import SamplingParams

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


def test_an_answer_check_that_runs_out_in_an_environment_is_counted_on_that_episode_once():
    pytest.importorskip("math_verify")
    from unirl_lightning.envs.calculator import CalculatorEnv
    from unirl_lightning.rewards import MathVerifyReward

    reward = MathVerifyReward(timeout_seconds=1)  # shared by the episodes' environments, as in a worker
    spec = resolve_environment(CalculatorEnv, {"syntax": "compact", "reward": reward})
    coordinator = EpisodeCoordinator(ScriptedEngine(), spec, SamplingParams(max_new_tokens=2))
    slow = "8888** 8** 8"  # sympy builds 8888**(8**8): parsing the reference runs out of time
    coordinator.submit(requests_for([{"prompt": "1?", "answer": slow}, {"prompt": "2?", "answer": "5"}]))
    samples = {s.sample_id: s for s in drain(coordinator)}  # every episode answers "5" at its first turn
    assert {k: (s.reward, s.reward_timeouts) for k, s in samples.items()} == {
        "g0/0": (0.0, 1),  # ran out: scored wrong
        "g0/1": (0.0, 0),  # the same pair again: the checker's cached verdict, no second check
        "g1/0": (1.0, 0),
        "g1/1": (1.0, 0),
    }
    assert reward.timeouts == 1


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


# --- truncated turns, the context budget, seeds ----------------------------------------------------


class CharChatTokenizer:
    """One id per character (``ord``); the chat template renders ``<role>content</>`` and the
    generation prompt ``<assistant>``, so an assistant message ends with ``</>``."""

    chat_template = "fake"

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(ch) for ch in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def chars(text: str) -> list[int]:
    return [ord(ch) for ch in text]


class ChatCountdownEnv(CountdownEnv):
    """CountdownEnv whose initial observation is one chat message (rendered with the chat template)."""

    def on_reset(self, record):
        super().on_reset(record)
        return [{"role": "user", "content": record["prompt"]}]


class CutEngine:
    """Every row answers ``completion`` with ``finish`` (``"length"``: cut at the token budget, no end
    of turn); records each call's contexts and seed. ``max_model_len`` is set only when given."""

    def __init__(self, tokenizer, completion, finish="length", max_model_len=None):
        self.tokenizer, self.completion, self.finish = tokenizer, completion, finish
        self.weight_version = 0
        self.calls: list[list[list[int]]] = []
        self.seeds: list[int] = []
        if max_model_len is not None:
            self.max_model_len = max_model_len

    def generate_ids(self, prompt_ids, sampling, seed=None):
        self.calls.append([list(ids) for ids in prompt_ids])
        self.seeds.append(seed)
        return [(list(self.completion), [-0.5] * len(self.completion), self.finish) for _ in prompt_ids]


def play(engine, env, records, settings, max_new_tokens=2, n=1):
    coordinator = EpisodeCoordinator(
        engine, resolve_environment(env), SamplingParams(max_new_tokens=max_new_tokens), settings
    )
    coordinator.submit(requests_for(records, n=n))
    return coordinator, {s.sample_id: s for s in drain(coordinator)}


def test_a_truncated_chat_turn_is_closed_with_the_templates_end_of_turn_masked_out_before_the_next_observation():
    engine = CutEngine(CharChatTokenizer(), chars("5"))
    coordinator, samples = play(
        engine, ChatCountdownEnv, countdown_records([3]), EpisodeSettings("raise", "close")
    )
    sample = samples["g0/0"]
    observation = chars("<user>,</><assistant>")
    turn = chars("5") + chars("</>") + observation
    assert sample.completion_ids == turn + turn + chars("5")
    assert sample.loss_mask == ([1] + [0] * 3 + [0] * len(observation)) * 2 + [1]  # the closing: loss_mask 0
    assert sample.logprobs == ([-0.5] + [0.0] * (3 + len(observation))) * 2 + [-0.5]
    assert engine.calls[1][0] == sample.prompt_ids + turn  # the next turn sees well-formed chat
    assert (sample.num_turns, sample.truncated_turns, coordinator.truncated_turns) == (3, 3, 3)
    assert sample.reward == pytest.approx(0.3)
    assert sample.finish_reason == "stop" and not sample.context_limited


def test_a_truncated_chat_turn_under_end_ends_the_episode_with_the_return_so_far():
    engine = CutEngine(CharChatTokenizer(), chars("5"))
    coordinator, samples = play(
        engine, ChatCountdownEnv, countdown_records([3]), EpisodeSettings("raise", "end")
    )
    sample = samples["g0/0"]
    assert (sample.num_turns, sample.completion_ids, sample.loss_mask) == (1, chars("5"), [1])
    # CountdownEnv pays on its last step only: the return so far is that of turn 1, 0
    assert sample.reward == 0.0 and sample.finish_reason == "length" and not sample.truncated
    assert sample.truncated_turns == 1 and coordinator.truncated_turns == 1 and len(engine.calls) == 1


def test_a_closed_chat_turn_is_left_as_it_is():
    engine = CutEngine(CharChatTokenizer(), chars("5</>"), finish="stop")
    coordinator, samples = play(
        engine, ChatCountdownEnv, countdown_records([2]), EpisodeSettings("raise", "end")
    )
    sample = samples["g0/0"]
    assert sample.completion_ids == chars("5</>") + chars("<user>,</><assistant>") + chars("5</>")
    assert sample.num_turns == 2 and sample.truncated_turns == 0 == coordinator.truncated_turns


@pytest.mark.parametrize("truncated_turn", ["close", "end"])
def test_raw_string_episodes_have_no_end_of_turn_so_a_cut_turn_appends_nothing(truncated_turn):
    """The tiny recipes' compact syntax: one token per turn (always "length"), no chat template."""
    engine = CutEngine(TOKENIZER, [FIVE])
    coordinator, samples = play(
        engine,
        CountdownEnv,
        countdown_records([3]),
        EpisodeSettings("raise", truncated_turn),
        max_new_tokens=1,
    )
    sample = samples["g0/0"]
    assert sample.completion_ids == [FIVE, COMMA, FIVE, COMMA, FIVE] and sample.loss_mask == [1, 0, 1, 0, 1]
    assert sample.num_turns == 3 and sample.truncated_turns == 0 == coordinator.truncated_turns


def test_the_context_budget_ends_an_episode_before_a_turn_would_pass_it_and_never_raises():
    engine = CutEngine(TOKENIZER, [FIVE, EOS], finish="stop")
    # prompt "9?" (2) + 2 new tokens per turn + "," after each: turns 1 and 2 fit in 8 tokens, turn 3 would not
    coordinator, samples = play(
        engine, CountdownEnv, countdown_records([9]), EpisodeSettings(max_context_tokens=8)
    )
    sample = samples["g0/0"]
    assert sample.num_turns == 2 and sample.context_limited and coordinator.context_limited == 1
    assert sample.completion_ids == [
        FIVE,
        EOS,
        COMMA,
        FIVE,
        EOS,
    ]  # the observation after the last turn is cut
    assert sample.loss_mask == [1, 1, 0, 1, 1] and len(sample.logprobs) == 5
    assert sample.reward == 0.0 and sample.finish_reason == "length" and sample.env_error is None
    assert all(len(context) + 2 <= 8 for call in engine.calls for context in call)


def test_the_engines_max_model_len_is_a_context_budget_too_and_the_tighter_one_wins():
    engine = CutEngine(TOKENIZER, [FIVE, EOS], finish="stop", max_model_len=8)
    _, samples = play(engine, CountdownEnv, countdown_records([9]), EpisodeSettings(max_context_tokens=100))
    assert samples["g0/0"].num_turns == 2 and samples["g0/0"].context_limited
    # a prompt that leaves no room for one turn ends at once, before any generation call
    engine = CutEngine(TOKENIZER, [FIVE, EOS], finish="stop", max_model_len=3)
    coordinator, samples = play(engine, CountdownEnv, countdown_records([9]), "raise")
    sample = samples["g0/0"]
    assert (sample.num_turns, sample.completion_ids, sample.context_limited) == (0, [], True)
    assert engine.calls == [] and coordinator.context_limited == 1


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"truncated_turn": "trim"}, r"truncated_turn must be one of \('close', 'end'\), got 'trim'"),
        ({"max_context_tokens": 0}, "max_context_tokens must be None or an int >= 1, got 0"),
        ({"on_env_error": "ignore"}, r"on_env_error must be one of \('raise', 'drop'\), got 'ignore'"),
    ],
)
def test_episode_settings_refuse_bad_values(settings, message):
    with pytest.raises(ValueError, match=message):
        EpisodeSettings(**settings)


def test_turn_seeds_are_distinct_over_many_episodes_and_turns():
    seeds = {turn_seed(episode, turn) for episode in range(2000) for turn in range(20)}
    assert len(seeds) == 2000 * 20 and all(0 <= seed < 2**63 for seed in seeds)
    assert turn_seed(7, 3) == turn_seed(7, 3) != turn_seed(3, 7)
    assert call_seed([5]) == 5 and call_seed([5, 6]) != call_seed([6, 5])


def test_an_episodes_turn_seeds_do_not_depend_on_the_drive_that_plays_it():
    """A lone episode played straight through, and the same one aborted and resumed in another drive,
    get the same per-turn seeds: the hash of (episode seed, turn index)."""
    records = countdown_records([6])
    engine = CutEngine(TOKENIZER, [FIVE, EOS], finish="stop")
    play(engine, CountdownEnv, records, "raise")
    assert engine.seeds == [turn_seed(0, turn) for turn in range(6)]
    engine = CutEngine(TOKENIZER, [FIVE, EOS], finish="stop")
    spec = resolve_environment(CountdownEnv, {"step_sleep_s": 0.05})
    coordinator = EpisodeCoordinator(engine, spec, SamplingParams(max_new_tokens=2))
    coordinator.submit(requests_for(records, n=1))
    deadline = time.monotonic() + 10
    while len(engine.seeds) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    coordinator.abort()
    assert coordinator.suspended() == ["g0/0"] and 0 < len(engine.seeds) < 6
    coordinator.submit([EpisodeRequest("g0/0", records[0], seed=99)])  # a resumed request's seed is not used
    (sample,) = drain(coordinator)
    assert sample.num_turns == 6 and engine.seeds == [turn_seed(0, turn) for turn in range(6)]


@needs_smollm2
def test_the_end_of_a_chatml_assistant_turn_is_im_end_and_a_newline():
    tokenizer = smollm2_tokenizer()
    assert tokenizer.convert_ids_to_tokens(turn_closing_ids(tokenizer)) == ["<|im_end|>", "Ċ"]
