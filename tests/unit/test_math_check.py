"""Pins unirl_lightning.rewards.math_check: math_verify's verdicts, bounded by its timeout on every
thread (in place on the main thread, in a child process off it), cached per pair, counted and
logged when they run out."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("math_verify")

from unirl_lightning.rewards import (  # noqa: E402
    MathVerifyReward,
    math_check,  # noqa: E402
    score_batch,
)
from unirl_lightning.rewards.math_check import AnswerChecker, _Child  # noqa: E402

# sympy builds 8888**(8**8) for this 12-character completion: about two minutes unbounded.
SLOW = "8888** 8** 8"
PAIRS = [("7", "The answer is \\boxed{7}"), ("1/2", "0.5"), ("7", "8"), ("7", "no answer")]


def off_main_thread(fn, *args):
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn, *args).result()


def test_verdicts_are_math_verifys_on_the_main_thread_and_off_it():
    assert AnswerChecker().check(PAIRS) == [True, True, False, False]
    checker = AnswerChecker()
    try:
        assert off_main_thread(checker.check, PAIRS) == [True, True, False, False]
        assert _Child.shared(5).process is not None  # off the main thread the child process checked them
    finally:
        checker.close()


def test_a_text_against_itself_is_parsed_not_compared(monkeypatch):
    import math_verify  # check_pair imports verify from it per call: patched there

    compared = []

    verify = math_verify.verify
    monkeypatch.setattr(math_verify, "verify", lambda *a, **k: compared.append(a) or verify(*a, **k))
    texts = ["\\boxed{7}", "no answer", SLOW]
    assert AnswerChecker(timeout_seconds=1).check([(t, t) for t in texts]) == [True, False, True]
    assert compared == []  # the slow one answers at once: no comparison ran
    assert AnswerChecker().check([("7", "\\boxed{7}")]) == [True] and len(compared) >= 1


def test_a_pathological_completion_times_out_on_the_main_thread_scores_incorrect_and_is_logged(caplog):
    reward = MathVerifyReward(timeout_seconds=1)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="unirl_lightning.rewards.math_check"):
        assert reward([SLOW, "5"], [{"answer": "5"}] * 2) == [0.0, 1.0]
    assert time.monotonic() - start < 30  # bounded: unbounded it is about 120 s
    assert reward.timeouts == 1
    assert "'8888** 8** 8'" in caplog.text and "reference '5'" in caplog.text and "1 timeouts" in caplog.text


def test_off_the_main_thread_the_timeout_still_holds():
    reward = MathVerifyReward(timeout_seconds=1)
    try:
        start = time.monotonic()
        assert off_main_thread(score_batch, reward, [SLOW, "5"], [{"answer": "5"}] * 2) == [0.0, 1.0]
        assert time.monotonic() - start < 60  # the child's start (imports) plus one bounded check
        assert reward.timeouts == 1
    finally:
        reward.checker.close()


def test_a_repeated_pair_is_checked_once_within_a_batch_and_across_batches():
    reward = MathVerifyReward(timeout_seconds=1)
    records = [{"answer": "5"}] * 8
    assert reward([SLOW] * 8, records) == [0.0] * 8
    assert reward([SLOW] * 8, records) == [0.0] * 8
    assert reward.timeouts == 1


def test_the_cache_is_bounded_least_recently_used_first():
    checker = AnswerChecker(cache_size=2)
    checker.check([("1", "1"), ("2", "2"), ("3", "3")])
    assert list(checker._cache) == [math_check._key(("2", "2")), math_check._key(("3", "3"))]


def test_a_dead_child_is_replaced_and_a_stuck_one_is_killed_and_counted(monkeypatch):
    checker = AnswerChecker(timeout_seconds=1)
    try:
        assert off_main_thread(checker.check, [("1", "1")]) == [True]
        child = _Child.shared(1)
        child.process.kill()
        child.process.wait()
        assert off_main_thread(checker.check, [("2", "2")]) == [True]  # a fresh child
        stuck = child.process
        os.kill(stuck.pid, signal.SIGSTOP)  # past every alarm: no reply comes
        monkeypatch.setattr(math_check, "_CHECKS_PER_PAIR", 0)
        monkeypatch.setattr(math_check, "_SLACK_S", 1.0)
        assert off_main_thread(checker.check, [("3", "3"), ("4", "4")]) == [False, True]
        assert stuck.poll() is not None and checker.timeouts == 1
    finally:
        checker.close()


def test_checkers_built_per_call_share_one_child_process():
    pids = set()
    for _ in range(3):
        checker = AnswerChecker(timeout_seconds=1)
        assert off_main_thread(checker.check, [("7", "7")]) == [True]
        pids.add(_Child.shared(1).process.pid)
    assert len(pids) == 1
    checker.close()


def test_the_reward_pickles_without_its_cache_and_scores_the_same():
    reward = MathVerifyReward()
    off_main_thread(reward, ["7"], [{"answer": "7"}])  # starts a child
    try:
        restored = pickle.loads(pickle.dumps(reward))
        assert not restored.checker._cache
        assert restored(["7", "8"], [{"answer": "7"}] * 2) == [1.0, 0.0]
    finally:
        reward.checker.close()


def test_a_bad_timeout_names_the_key_and_the_allowed_values():
    with pytest.raises(ValueError, match=r"timeout_seconds=1.5 is invalid; expected None or an int >= 0"):
        AnswerChecker(timeout_seconds=1.5)
