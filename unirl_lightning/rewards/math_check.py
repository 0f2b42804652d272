"""``math_verify``'s answer check on text pairs, with its timeout enforced on every thread.

Contract: :meth:`AnswerChecker.check` takes ``(reference, answer)`` text pairs and says, for each,
whether ``math_verify.verify(parse(reference), parse(answer))`` holds. Every parse and every
comparison is bounded by ``timeout_seconds``; one that runs out counts in
:attr:`AnswerChecker.timeouts`, is logged once with the texts, and checks as ``False``. Verdicts are
cached per pair, so a completion repeated across a group (or across steps) costs one check.

Why a process: ``math_verify`` bounds its work with ``signal.alarm``, which works only on a
process's main thread, and says that elsewhere the caller must bound it. Some short completions
need that bound: ``8888** 8** 8`` against ``5`` makes sympy build ``8888**(8**8)``, two minutes
of work. On the main thread the check runs in place under the alarm. On any other thread (a
threaded Ray actor, a thread pool) the pairs go to one long-lived child interpreter per process
(running :func:`main`; shared by every checker with the same timeout) that runs the same check on
*its* main thread; if it ever misses its deadline, it is killed, the pair counts as a timeout and a
fresh child takes the rest. ``timeout_seconds=None`` (or 0) disables the bound everywhere, as in
``math_verify``.

Example::

    >>> AnswerChecker().check([("7", "The answer is \\\\boxed{7}"), ("1/2", "0.5"), ("7", "8")])
    [True, True, False]
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import logging
import os
import selectors
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

__all__ = ["AnswerChecker", "check_pair"]

log = logging.getLogger(__name__)

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding unirl_lightning/
_START_S = 60.0  # a child's first answer may wait for its imports (sympy)
_CHECKS_PER_PAIR = 8  # a pair's parses and comparisons, each bounded in the child by its alarm
_SLACK_S = 10.0
_CHILD = "import sys; from unirl_lightning.rewards.math_check import main; sys.exit(main())"


def check_pair(reference: str, answer: str, timeout: int | None) -> tuple[bool, int]:
    """``math_verify`` on one pair in this thread: ``(verdict, timeouts)``. ``timeout`` is passed to
    ``math_verify`` as is (``signal.alarm``: main thread only). Each (reference, answer)
    extraction pair is compared on its own, as ``math_verify.verify`` does; an error other than a
    timeout makes that comparison ``False``, as there. A text checked against itself is parsed once
    and not compared: its verdict is whether it holds an answer ``math_verify`` can extract."""
    from itertools import product

    from math_verify import verify
    from math_verify.errors import TimeoutException

    gold, timeouts = _parsed(reference, timeout)
    if answer == reference:  # a text against itself: whether it holds an answer (no comparison)
        return bool(gold), timeouts
    prediction, more = _parsed(answer, timeout)
    timeouts += more
    for g, t in product(gold, prediction):
        try:
            if verify(g, t, timeout_seconds=timeout, raise_on_error=True):
                return True, timeouts
        except TimeoutException:
            timeouts += 1
        except Exception:
            pass
    return False, timeouts


def _parsed(text: str, timeout: int | None) -> tuple[list, int]:
    """``text``'s extractions and the timeouts spent on them (none extracted when parsing fails)."""
    from math_verify.errors import TimeoutException

    try:
        return _parse(text, timeout), 0
    except TimeoutException:
        return [], 1
    except Exception:
        return [], 0


@functools.lru_cache(maxsize=8192)
def _parse(text: str, timeout: int | None) -> list:
    """``math_verify.parse``, memoised (a group repeats its reference, a vote re-reads its answers);
    a parse that raises, a timeout included, is not remembered."""
    from math_verify import parse

    return parse(text, parsing_timeout=timeout, raise_on_error=True)


class AnswerChecker:
    """Checks ``(reference, answer)`` pairs with ``math_verify`` (see the module docstring).

    Args:
        timeout_seconds: Bound on each parse and each comparison; ``None`` or ``0`` disables it.
        cache_size: Verdicts kept (least recently used dropped first).

    Thread-safe. Picklable (a Ray actor's reward): the cache is not sent.
    """

    def __init__(self, timeout_seconds: int | None = 5, cache_size: int = 16384) -> None:
        if timeout_seconds is not None and (not isinstance(timeout_seconds, int) or timeout_seconds < 0):
            raise ValueError(
                f"AnswerChecker timeout_seconds={timeout_seconds!r} is invalid; expected None or an int >= 0."
            )
        self.timeout_seconds = timeout_seconds or None
        self.cache_size = cache_size
        self.timeouts = 0
        self._reset()

    def _reset(self) -> None:
        self._cache: collections.OrderedDict[bytes, bool] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_cache", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    def check(self, pairs: Sequence[tuple[str, str]]) -> list[bool]:
        """One verdict per ``(reference, answer)`` pair."""
        keys = [_key(pair) for pair in pairs]  # digests: long completions do not fill memory
        with self._lock:
            verdicts = [self._cache.get(key) for key in keys]
            todo = list(dict.fromkeys((k, p) for k, p, v in zip(keys, pairs, verdicts) if v is None))
            if todo:
                found = dict(zip((k for k, _ in todo), self._check([p for _, p in todo])))
                verdicts = [found[k] if v is None else v for k, v in zip(keys, verdicts)]
            for key, verdict in zip(keys, verdicts):
                self._cache[key] = verdict
                self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return verdicts

    def _check(self, pairs: list[tuple[str, str]]) -> list[bool]:
        in_place = self.timeout_seconds is None or threading.current_thread() is threading.main_thread()
        results = (
            [check_pair(r, a, self.timeout_seconds) for r, a in pairs] if in_place else self._remote(pairs)
        )
        for (reference, answer), (_, timeouts) in zip(pairs, results):
            if timeouts:
                self.timeouts += timeouts
                log.warning(
                    "math_verify ran out of its %s s checking answer %r against reference %r; scored "
                    "incorrect (%d timeouts so far).",
                    self.timeout_seconds,
                    answer[:200],
                    reference[:200],
                    self.timeouts,
                )
        return [verdict for verdict, _ in results]

    def _remote(self, pairs: list[tuple[str, str]]) -> list[tuple[bool, int]]:
        return _Child.shared(self.timeout_seconds).check(pairs)

    def close(self) -> None:
        """Stop the child process this checker's timeout uses, if one runs (a later check starts
        another). It is shared by every checker of this process with the same timeout."""
        _Child.shared(self.timeout_seconds).close()


class _Child:
    """The child interpreter that checks pairs off the main thread: one per process and timeout,
    shared by every :class:`AnswerChecker` (a reward built per call costs no new process)."""

    _instances: dict[int | None, _Child] = {}
    _instances_lock = threading.Lock()

    @classmethod
    def shared(cls, timeout: int | None) -> _Child:
        with cls._instances_lock:
            if timeout not in cls._instances:
                cls._instances[timeout] = cls(timeout)
            return cls._instances[timeout]

    def __init__(self, timeout: int | None) -> None:
        self.timeout = timeout
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None

    def check(self, pairs: list[tuple[str, str]]) -> list[tuple[bool, int]]:
        deadline = _CHECKS_PER_PAIR * (self.timeout or 0) + _SLACK_S
        results: list[tuple[bool, int]] = []
        with self.lock:
            for reference, answer in pairs:
                started = self.process is None or self.process.poll() is not None
                if started:
                    self._start()
                try:
                    self.process.stdin.write((json.dumps([reference, answer]) + "\n").encode())
                    self.process.stdin.flush()
                    reply = _read_line(self.process, deadline + (_START_S if started else 0.0))
                except (BrokenPipeError, OSError):
                    reply = None
                if reply is None:  # stuck past every alarm, or dead: a fresh child takes the rest
                    self._kill()
                    results.append((False, 1))
                    continue
                verdict, timeouts = json.loads(reply)
                results.append((bool(verdict), int(timeouts)))
        return results

    def _start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(self.timeout)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )

    def _kill(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def close(self) -> None:
        with self.lock:
            self._kill()


def _key(pair: tuple[str, str]) -> bytes:
    """A pair's cache key: a digest of both texts."""
    reference, answer = pair
    return hashlib.blake2b(f"{len(reference)}:{reference}{answer}".encode(), digest_size=16).digest()


def _read_line(child: subprocess.Popen, seconds: float) -> bytes | None:
    """One line of ``child``'s stdout within ``seconds``, else ``None``."""
    with selectors.DefaultSelector() as selector:
        selector.register(child.stdout, selectors.EVENT_READ)
        if not selector.select(timeout=seconds):
            return None
    line = child.stdout.readline()
    return line or None


def main() -> int:
    """The child: one JSON ``[reference, answer]`` per stdin line, one ``[verdict, timeouts]`` out."""
    timeout = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] != "None" else None
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    for line in sys.stdin:
        reference, answer = json.loads(line)
        sys.stdout.write(json.dumps(check_pair(reference, answer, timeout)) + "\n")
        sys.stdout.flush()
    return 0
