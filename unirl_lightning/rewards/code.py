"""Code-execution reward: run a completion's Python against its record's tests, in a sandbox.

Contract: :class:`CodeExecutionReward` is a batch reward (``__call__(completions, records)``, called
through ``score_batch`` in the rollout worker that generated the batch). Each completion's code
runs in a :class:`~unirl_lightning.rewards.sandbox.Sandbox` (``bwrap``: no network, no host files
but the interpreter, rlimits and a timeout; see :mod:`unirl_lightning.rewards.sandbox`), at most
``max_concurrency`` runs at once per worker process. A completion scores the fraction of its
tests passed (or 1/0 with ``scoring="all"``); code that loops, crashes, exhausts a limit or
attacks the sandbox scores 0 for the tests it did not pass. Raises only for configuration and
infrastructure faults: a record without tests, a malformed test, no usable sandbox
(:class:`~unirl_lightning.rewards.sandbox.SandboxUnavailableError`).

The record's tests (``record[tests_key]``, a list or its JSON string), either kind:

* ``{"input": [arg, ...], "output": value}``: call ``record[entry_point_key]`` (default ``"f"``)
  with the arguments; passed when the JSON of its result equals ``value`` (numbers within
  ``1e-9``). All of a completion's call tests run in one sandbox run.
* ``{"stdin": "...", "stdout": "..."}``: run the code as a program; passed when it exits normally
  and its stdout equals ``stdout`` up to trailing whitespace on each line and trailing blank
  lines (LiveCodeBench / DeepCoder style). One sandbox run per test.

Expected outputs never enter the sandbox; the host compares.

The code is the last fenced code block of the completion (```` ```python ```` or a bare fence),
else the whole completion; with ``prefix_key`` the record's text at that key comes first
(HumanEval-style: the prompt is the function's signature and the completion its body).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import queue
import re
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

from unirl_lightning.rewards.base import Reward, _record_field
from unirl_lightning.rewards.sandbox import Sandbox, SandboxLimits, SandboxResult

__all__ = ["CodeExecutionReward", "TestReport", "compare_output", "extract_code", "same_value"]

Scoring = Literal["fraction", "all"]

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)

_slots_lock = threading.Lock()
_slots: dict[int, queue.Queue] = {}


def _process_slots(size: int) -> queue.Queue:
    """The process's run slots for a concurrency of ``size``: a semaphore whose tokens are slot numbers."""
    with _slots_lock:
        if size not in _slots:
            slots: queue.Queue = queue.Queue()
            for slot in range(size):
                slots.put(slot)
            _slots[size] = slots
        return _slots[size]


def extract_code(completion: str) -> str:
    """The last fenced code block of ``completion`` (an unclosed last fence runs to the end), else all of it.

    Example::

        >>> extract_code("Here:\\n```python\\ndef f(x):\\n    return x\\n```\\nDone.")
        'def f(x):\\n    return x\\n'
        >>> extract_code("+3")
        '+3'
    """
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def same_value(value: Any, expected: Any, tolerance: float = 1e-9) -> bool:
    """JSON values equal, numbers within ``tolerance`` (absolute and relative); bools are not numbers.

    Example::

        >>> same_value([1, 0.30000000000000004], [1, 0.3]), same_value(True, 1), same_value({"a": 1}, {"a": 1})
        (True, False, True)
    """
    if isinstance(value, bool) or isinstance(expected, bool):
        return type(value) is type(expected) and value == expected
    if isinstance(value, (int, float)) and isinstance(expected, (int, float)):
        return math.isclose(value, expected, rel_tol=tolerance, abs_tol=tolerance)
    if isinstance(value, list) and isinstance(expected, list):
        return len(value) == len(expected) and all(
            same_value(a, b, tolerance) for a, b in zip(value, expected)
        )
    if isinstance(value, dict) and isinstance(expected, dict):
        return value.keys() == expected.keys() and all(
            same_value(value[k], expected[k], tolerance) for k in value
        )
    return value == expected


def compare_output(printed: str, expected: str) -> bool:
    """Program output equal up to trailing whitespace on each line and trailing blank lines.

    Example::

        >>> compare_output("3 \\n4\\n\\n", "3\\n4"), compare_output("3\\n5", "3\\n4")
        (True, False)
    """

    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]

    return lines(printed) == lines(expected)


@dataclass
class TestReport:
    """What :meth:`CodeExecutionReward.run_tests` found: tests passed, one outcome per test (what the
    function returned, the program printed, or how the run ended), and every sandbox run."""

    __test__ = False  # not a pytest class

    passed: int
    total: int
    outcomes: list[str] = field(default_factory=list)
    runs: list[SandboxResult] = field(default_factory=list)


class _Frozen(dict):
    """A test dict that hashes by its JSON (so identical runs are found), read like the dict."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(json.dumps(self, sort_keys=True, default=str))


def _ending(result: SandboxResult) -> str:
    if result.timed_out:
        return f"killed after its {result.elapsed_s:.1f} s timeout"
    if result.output_truncated:
        return "killed: output over the limit"
    if result.returncode is not None and result.returncode < 0:
        return f"killed by signal {-result.returncode}"
    return f"exit {result.returncode}, no result"


class CodeExecutionReward(Reward):
    """Fraction (or all-or-nothing) of a record's tests a completion's code passes, run sandboxed.

    See the module docstring for the test formats and what runs where.

    Args:
        tests_key: Record key of the tests (a list of test dicts, or its JSON string).
        entry_point_key: Record key naming the function the call tests call.
        default_entry_point: The function's name when the record has no ``entry_point_key``.
        prefix_key: Record key whose text is put before the completion's code (HumanEval-style
            completions of a given signature); None = the completion's code alone.
        scoring: ``"fraction"`` (tests passed / tests) or ``"all"`` (1.0 only when every test passes).
        max_concurrency: Sandbox runs at once in one worker process (a semaphore shared by the
            process's code rewards of this concurrency).
        timeout_s: Wall-clock seconds of one sandbox run (all call tests of a completion, or one
            stdin/stdout test); the run is then killed with everything it started.
        cpu_time_s: CPU seconds of one run.
        memory_bytes: Address space of each sandboxed process.
        file_size_bytes: Largest file the code may write (in its tmpfs).
        tmpfs_bytes: Size of the sandbox's ``/tmp`` and of its home (each).
        max_processes: Processes and threads the code may have at once.
        max_output_bytes: Stdout read from one run; past it the run is killed (its tests fail).
        python: Interpreter inside the sandbox; None = the worker's own (outside any venv).
        bwrap: The ``bwrap`` executable (name on PATH or path).
        allow_unsandboxed: Without ``bwrap``, run the code as plain child processes (a loud warning;
            rlimits and the timeout still apply) instead of refusing.
        name: Name in logs (``rollout/reward/<name>_mean``) and errors.

    Raises:
        SandboxUnavailableError: at the first run in a worker process (``score_batch`` wraps it in a
            ``RewardError``, which stops the run), when ``bwrap`` is missing there or cannot sandbox
            and ``allow_unsandboxed`` is false. Constructing the reward runs nothing (``plan`` and
            the trainer's process build it too).

    Example::

        # YAML
        # reward:
        #   class_path: unirl_lightning.rewards.CodeExecutionReward
        #   init_args: {scoring: fraction, timeout_s: 5, max_concurrency: 4}
        reward = CodeExecutionReward()
        reward(["```python\\ndef f(x):\\n    return 2 * x\\n```"],
               [{"tests": [{"input": [1], "output": 2}, {"input": [3], "output": 5}]}])  # -> [0.5]
    """

    name = "code_execution"

    def __init__(
        self,
        tests_key: str = "tests",
        entry_point_key: str = "entry_point",
        default_entry_point: str = "f",
        prefix_key: str | None = None,
        scoring: Scoring = "fraction",
        max_concurrency: int = 4,
        timeout_s: float = 10.0,
        cpu_time_s: int = 5,
        memory_bytes: int = 1 << 30,
        file_size_bytes: int = 16 << 20,
        tmpfs_bytes: int = 64 << 20,
        max_processes: int = 32,
        max_output_bytes: int = 1 << 20,
        python: str | None = None,
        bwrap: str = "bwrap",
        allow_unsandboxed: bool = False,
        name: str = "code_execution",
    ) -> None:
        if scoring not in ("fraction", "all"):
            raise ValueError(
                f"CodeExecutionReward scoring={scoring!r} is invalid; expected 'fraction' or 'all'."
            )
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(
                f"CodeExecutionReward max_concurrency={max_concurrency!r} is invalid; expected an int >= 1."
            )
        limits = SandboxLimits(
            timeout_s=timeout_s,
            cpu_time_s=cpu_time_s,
            memory_bytes=memory_bytes,
            file_size_bytes=file_size_bytes,
            tmpfs_bytes=tmpfs_bytes,
            max_processes=max_processes,
            max_output_bytes=max_output_bytes,
        )
        self.tests_key = tests_key
        self.entry_point_key = entry_point_key
        self.default_entry_point = default_entry_point
        self.prefix_key = prefix_key
        self.scoring = scoring
        self.max_concurrency = max_concurrency
        self.sandbox = Sandbox(limits, python=python, bwrap=bwrap, allow_unsandboxed=allow_unsandboxed)
        self.name = name

    def __call__(self, completions: list[str], records: list[dict]) -> list[float]:
        # the same program against the same tests runs once (a group often repeats a completion)
        jobs = [self._job(completion, record) for completion, record in zip(completions, records)]
        unique = list(dict.fromkeys(jobs))
        if len(unique) <= 1:
            reports = [self._run_tests(*job) for job in unique]
        else:
            with concurrent.futures.ThreadPoolExecutor(
                max_workers=min(self.max_concurrency, len(unique))
            ) as pool:
                reports = list(pool.map(lambda job: self._run_tests(*job), unique))
        scores = {job: self._score(report) for job, report in zip(unique, reports)}
        return [scores[job] for job in jobs]

    def score(self, completion: str, record: dict) -> float:
        return self._score(self.run_tests(completion, record))

    # -- one completion -----------------------------------------------------------------------------
    def _tests(self, record: dict) -> list[dict]:
        tests = _record_field(record, self.tests_key, self.name)
        if isinstance(tests, str):
            try:
                tests = json.loads(tests)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"Reward {self.name!r}: record[{self.tests_key!r}] is a string but not JSON ({err}): "
                    f"{tests[:200]!r}"
                ) from None
        if not isinstance(tests, list) or not tests:
            raise ValueError(
                f"Reward {self.name!r}: record[{self.tests_key!r}] must be a non-empty list of tests, got {tests!r}"
            )
        for test in tests:
            if not isinstance(test, dict) or not ({"input", "output"} <= test.keys() or "stdout" in test):
                raise ValueError(
                    f"Reward {self.name!r}: test {test!r} is malformed; expected "
                    "{'input': [args...], 'output': value} or {'stdin': str, 'stdout': str}."
                )
        return tests

    def run_tests(self, completion: str, record: dict) -> TestReport:
        """Run ``completion`` against ``record``'s tests in the sandbox: what passed, and each run.

        Raises:
            KeyError / ValueError: the record has no tests, or a malformed one (named).
            SandboxUnavailableError: no usable sandbox and ``allow_unsandboxed`` is false.
        """
        return self._run_tests(*self._job(completion, record))

    def _job(self, completion: str, record: dict) -> tuple[str, tuple, str]:
        """Checks the record now (errors name it): the program, its tests (hashable) and entry point."""
        tests = self._tests(record)
        code = extract_code(completion)
        if self.prefix_key is not None:
            code = str(_record_field(record, self.prefix_key, self.name)) + code
        entry_point = str(record.get(self.entry_point_key) or self.default_entry_point)
        return code, tuple(_Frozen(test) for test in tests), entry_point

    def _score(self, report: TestReport) -> float:
        if self.scoring == "all":
            return 1.0 if report.passed == report.total else 0.0
        return report.passed / report.total

    def _run_tests(self, code: str, tests: tuple, entry_point: str) -> TestReport:
        report = TestReport(passed=0, total=len(tests))
        calls = [test for test in tests if "input" in test]
        if calls:
            self._run_calls(code, calls, entry_point, report)
        for test in tests:
            if "input" in test:
                continue
            result = self._run({"mode": "stdio", "code": code, "stdin": str(test.get("stdin", ""))})
            printed = result.stdout.decode(errors="replace")
            report.runs.append(result)
            report.outcomes.append(printed if result.ok else _ending(result))
            report.passed += bool(result.ok and compare_output(printed, str(test["stdout"])))
        return report

    def _run_calls(self, code: str, tests: list[dict], entry_point: str, report: TestReport) -> None:
        tag = "@unirl-result-" + secrets.token_hex(8)
        inputs = [list(t["input"]) if isinstance(t["input"], (list, tuple)) else [t["input"]] for t in tests]
        result = self._run(
            {"mode": "call", "code": code, "entry_point": entry_point, "inputs": inputs, "tag": tag}
        )
        entries: dict[int, dict] = {}
        for line in result.stdout.decode(errors="replace").splitlines():
            if line.startswith(tag + " "):
                try:
                    entry = json.loads(line[len(tag) + 1 :])
                except json.JSONDecodeError:
                    continue
                if isinstance(entry, dict) and isinstance(entry.get("index"), int):
                    entries[entry["index"]] = entry
        report.runs.append(result)
        for index, test in enumerate(tests):
            entry = entries.get(index) or entries.get(-1) or {"error": _ending(result)}
            if "value" in entry:
                report.outcomes.append(f"returned {json.dumps(entry['value'])[:200]}")
                report.passed += same_value(entry["value"], json.loads(json.dumps(test["output"])))
            else:
                report.outcomes.append(str(entry.get("error"))[:200])

    def _run(self, payload: dict) -> SandboxResult:
        slots = _process_slots(self.max_concurrency)
        slot = slots.get()
        try:
            return self.sandbox.run(payload, slot=slot)
        finally:
            slots.put(slot)
