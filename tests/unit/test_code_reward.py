"""CodeExecutionReward: the test formats, the scoring settings, what enters the sandbox, the
concurrency bound, pickling and the errors for bad records."""

from __future__ import annotations

import json
import pickle
import threading

import pytest

from unirl_lightning.rewards import CodeExecutionReward, RewardError, part_name, score_parts
from unirl_lightning.rewards.code import compare_output, extract_code, same_value
from unirl_lightning.rewards.sandbox import Sandbox, SandboxUnavailableError

try:
    SANDBOXED = Sandbox().check() == "bwrap"
except SandboxUnavailableError:
    SANDBOXED = False
pytestmark = pytest.mark.skipif(not SANDBOXED, reason="bubblewrap is not installed or cannot sandbox here")

DOUBLE = [{"input": [1], "output": 2}, {"input": [3], "output": 6}, {"input": [-2], "output": -4}]


def test_a_completion_scores_the_fraction_of_call_tests_its_function_passes():
    reward = CodeExecutionReward(timeout_s=5)
    completions = [
        "Here you go:\n```python\ndef f(x):\n    return 2 * x\n```\nIt doubles.",
        "def f(x):\n    return x + 1 if x == 1 else x * 3",  # passes only f(1) == 2
        "def g(x):\n    return 2 * x",  # no f
        "def f(x):\n    raise ValueError(x)",
        "def f(x)\n    return",  # a syntax error
    ]
    assert reward(completions, [{"tests": DOUBLE}] * 5) == [1.0, pytest.approx(1 / 3), 0.0, 0.0, 0.0]


def test_all_or_nothing_scores_one_only_when_every_test_passes():
    reward = CodeExecutionReward(scoring="all", timeout_s=5)
    assert reward(
        ["def f(x):\n    return 2 * x", "def f(x):\n    return x + 1"], [{"tests": DOUBLE}] * 2
    ) == [1.0, 0.0]


def test_stdin_stdout_tests_compare_the_printed_output():
    tests = [
        {"stdin": "3 4\n", "stdout": "7\n"},
        {"stdin": "10 -2", "stdout": "8"},
        {"stdin": "1 1", "stdout": "3"},
    ]
    program = "a, b = map(int, input().split())\nprint(a + b)  \n"
    crashing = "import sys\nprint(7)\nsys.exit(3)\n"  # prints the first answer, then fails: not passed
    reward = CodeExecutionReward(timeout_s=5)
    assert reward([program, crashing], [{"tests": json.dumps(tests)}] * 2) == [pytest.approx(2 / 3), 0.0]


def test_the_entry_point_and_a_humaneval_style_prefix_come_from_the_record():
    record = {
        "prompt": 'def add3(x):\n    """x + 3"""\n    return x',
        "entry_point": "add3",
        "tests": [{"input": [0], "output": 3}, {"input": [5], "output": 8}],
    }
    reward = CodeExecutionReward(prefix_key="prompt", timeout_s=5)
    assert reward([" + 3", " * 3", "+3 if x else 0"], [record] * 3) == [1.0, 0.0, 0.5]


def test_an_object_that_claims_equality_with_everything_does_not_pass():
    cheat = "class Any:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return Any()\n"
    forged = (  # prints a result line of its own: it cannot know the expected value, which never enters
        "import gc\ndef f(x):\n    tag = next(o for o in gc.get_objects() if isinstance(o, dict) and 'tag' in o)['tag']\n"
        '    print(f\'\\n{tag} \' + \'{"index": 0, "value": "forged"}\')\n    return None\n'
    )
    reward = CodeExecutionReward(timeout_s=5)
    assert reward([cheat, forged], [{"tests": DOUBLE}] * 2) == [0.0, 0.0]


def test_expected_outputs_never_enter_the_sandbox(monkeypatch):
    payloads = []
    real_run = Sandbox.run

    def spy(self, payload, slot=0):
        payloads.append(json.dumps(payload))
        return real_run(self, payload, slot)

    monkeypatch.setattr(Sandbox, "run", spy)
    tests = [{"input": [1], "output": 918273645}, {"stdin": "x", "stdout": "564738291"}]
    CodeExecutionReward(timeout_s=5)(["def f(x):\n    return x"], [{"tests": tests}])
    assert len(payloads) == 2 and not any("918273645" in p or "564738291" in p for p in payloads)


def test_runs_in_one_worker_never_exceed_max_concurrency(monkeypatch):
    running, peak, lock = [0], [0], threading.Lock()
    real_run = Sandbox.run

    def counting(self, payload, slot=0):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            return real_run(self, payload, slot)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(Sandbox, "run", counting)
    reward = CodeExecutionReward(max_concurrency=2, timeout_s=10)
    slow = "import time\ndef f(x):\n    time.sleep(0.5)\n    return 2 * x\n"
    assert reward([slow + f"# {i}\n" for i in range(6)], [{"tests": DOUBLE[:1]}] * 6) == [1.0] * 6
    assert peak[0] == 2


def test_the_reward_pickles_and_checks_its_sandbox_again_where_it_lands():
    reward = CodeExecutionReward(timeout_s=5, name="unit_tests")
    clone = pickle.loads(pickle.dumps(reward))
    assert clone.sandbox._checked is None and clone.name == "unit_tests"
    assert clone(["def f(x):\n    return 2 * x"], [{"tests": DOUBLE}]) == [1.0]
    assert clone.sandbox._checked == "bwrap"


def test_its_scores_are_logged_under_its_name():
    totals, parts = score_parts(
        CodeExecutionReward(timeout_s=5), ["def f(x):\n    return 2 * x"], [{"tests": DOUBLE}]
    )
    assert totals == [1.0] and parts == {"code_execution": [1.0]}
    assert part_name(CodeExecutionReward(timeout_s=5, name="humaneval")) == "humaneval"


def test_bad_records_and_settings_are_named():
    reward = CodeExecutionReward(timeout_s=5)
    with pytest.raises(RewardError, match="needs record key 'tests'"):
        score_parts(reward, ["def f(x): pass"], [{"prompt": "p"}])
    with pytest.raises(RewardError, match=r"test \{'in': \[1\]\} is malformed"):
        score_parts(reward, ["def f(x): pass"], [{"prompt": "p", "tests": [{"in": [1]}]}])
    with pytest.raises(ValueError, match="scoring='most' is invalid; expected 'fraction' or 'all'"):
        CodeExecutionReward(scoring="most")
    with pytest.raises(ValueError, match="max_concurrency=0 is invalid"):
        CodeExecutionReward(max_concurrency=0)
    with pytest.raises(ValueError, match="timeout_s=-1 is invalid"):
        CodeExecutionReward(timeout_s=-1)


def test_without_bwrap_the_reward_refuses_at_its_first_batch_naming_the_fix():
    reward = CodeExecutionReward(bwrap="/nonexistent/bwrap")  # building it runs nothing
    with pytest.raises(RewardError, match="Refusing to run model-written code without a sandbox") as info:
        score_parts(reward, ["def f(x):\n    return 2 * x"], [{"tests": DOUBLE}])
    assert isinstance(info.value.__cause__, SandboxUnavailableError)
    assert "apt-get install bubblewrap" in str(info.value) and "allow_unsandboxed: true" in str(info.value)


def test_the_helpers():
    assert extract_code("```py\nA\n```\ntext\n```python\nB\n```") == "B\n"
    assert extract_code("```\nC") == "C"
    assert same_value([1.0, {"a": [2]}], [1, {"a": [2.0]}]) and not same_value(0, False)
    assert compare_output("1\n2  \n\n", "1\n2") and not compare_output("1\n2", "1 2")


def test_the_builtin_code_task_is_solved_by_its_answers_in_the_tiny_vocabulary():
    from unirl_lightning.data import make_task
    from unirl_lightning.models.causal_lm import CHAR_VOCAB

    records = make_task("python_functions", num_prompts=6, seed=3)
    reward = CodeExecutionReward(prefix_key="prompt", timeout_s=10)
    assert reward([r["answer"] for r in records], records) == [1.0] * 6
    identity = [sum(t["output"] == t["input"][0] for t in r["tests"]) / len(r["tests"]) for r in records]
    assert reward([""] * 6, records) == identity  # f(x) = x passes where a * x +- b happens to equal x
    assert reward(["=?"] * 6, records) == [0.0] * 6  # a syntax error
    assert all(set(r["answer"]) <= set(CHAR_VOCAB) for r in records)


def test_a_program_repeated_in_a_batch_runs_once(monkeypatch):
    runs = []
    real_run = Sandbox.run
    monkeypatch.setattr(
        Sandbox, "run", lambda self, payload, slot=0: runs.append(1) or real_run(self, payload, slot)
    )
    reward = CodeExecutionReward(timeout_s=5)
    good, bad = "def f(x):\n    return 2 * x", "def f(x):\n    return x"
    other = [{"input": [5], "output": 10}]
    scores = reward([good, bad, good, good, bad, good], [{"tests": DOUBLE}] * 5 + [{"tests": other}])
    assert (
        scores == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0] and len(runs) == 3
    )  # (good, DOUBLE), (bad, DOUBLE), (good, other)
