"""Run untrusted Python in a bubblewrap sandbox, under rlimits and a wall-clock timeout.

Contract: :meth:`Sandbox.run` starts one Python process on a payload (the program
:mod:`unirl_lightning.rewards.sandbox_runner` runs it), waits at most ``limits.timeout_s``, reads at
most ``limits.max_output_bytes`` of its stdout, and returns a :class:`SandboxResult`; it never raises
for what the code does (an infinite loop, a crash, a fork bomb: they are results). When the run
ends, on time or not, nothing it started is left: the sandbox's PID namespace dies with it.

The sandbox (``bwrap``, Debian's ``bubblewrap``):

* namespaces of its own: an empty network namespace (no interface but a down loopback), PID, IPC,
  UTS, cgroup, and a user namespace when the worker is not root;
* a read-only root built from nothing: ``/usr`` (and the ``/bin``, ``/lib*`` links to it), the
  interpreter's own prefix (e.g. a pyenv install), a fresh ``/proc`` and a minimal ``/dev``; no
  ``/etc``, no home, no repository, no other host path. ``/tmp`` and the home ``/home/sandbox``
  are fresh size-capped tmpfs mounts, gone when the run ends;
* ``--die-with-parent`` (the sandbox dies with the worker) and ``--new-session`` (no terminal
  injection); the environment is cleared;
* as root, the code runs as an unprivileged uid of its own (from :func:`sandbox_uid`: by the
  worker's pid and the run's slot), without capabilities: Linux does not enforce ``RLIMIT_NPROC``
  on uid 0. Otherwise it keeps the worker's uid inside its own user namespace;
* rlimits, set inside the sandbox by the runner: CPU seconds, address space, file size, processes
  (counted inside the sandbox's user namespace, or for its own uid as root), open files, no core
  files; plus the host's wall-clock timeout, which kills the whole process group and with it the
  PID namespace.

Without ``bwrap`` the sandbox refuses to run (:class:`SandboxUnavailableError`) unless
``allow_unsandboxed=True``: then the code runs as a plain child process in a fresh temporary
directory with the same rlimits and timeout, after a loud warning; it can then read what the
worker's user can read and open sockets, and as root the process limit is not enforced.

Who calls: :class:`~unirl_lightning.rewards.code.CodeExecutionReward`, in the rollout worker that
scores (never the trainer's process). Thread-safe: each run is its own process.

Example::

    sandbox = Sandbox(SandboxLimits(timeout_s=2))
    sandbox.run({"mode": "stdio", "code": "print(input()[::-1])", "stdin": "abc"}).stdout  # b"cba\\n"
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailableError",
    "find_bwrap",
    "sandbox_uid",
]

log = logging.getLogger(__name__)

RUNNER_SOURCE = (Path(__file__).with_name("sandbox_runner.py")).read_text()
"""The program the sandboxed interpreter runs (passed as ``-c``: no host file is bound for it)."""

SANDBOX_HOME = "/home/sandbox"
_TOP_LEVEL = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_STDERR_BYTES = 8192
_DRAIN_S = 2.0  # after a kill: how long to wait for the last holders of the output pipe to die


class SandboxUnavailableError(RuntimeError):
    """``bwrap`` is missing or cannot create its namespaces here, and unsandboxed runs are not allowed."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use.

    Args:
        timeout_s: Wall-clock seconds before the run is killed (with everything it started).
        cpu_time_s: CPU seconds (``RLIMIT_CPU``; SIGXCPU, then SIGKILL a second later).
        memory_bytes: Address space of each process (``RLIMIT_AS``).
        file_size_bytes: Largest file a process may write (``RLIMIT_FSIZE``).
        tmpfs_bytes: Size of each of the sandbox's tmpfs mounts (``/tmp`` and the home).
        max_processes: Processes (and threads) the code may have at once (``RLIMIT_NPROC``).
        max_open_files: Open file descriptors per process (``RLIMIT_NOFILE``).
        max_output_bytes: Stdout read from the run; past it the run is killed and marked truncated.
    """

    timeout_s: float = 10.0
    cpu_time_s: int = 5
    memory_bytes: int = 1 << 30
    file_size_bytes: int = 16 << 20
    tmpfs_bytes: int = 64 << 20
    max_processes: int = 32
    max_open_files: int = 64
    max_output_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for key, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"SandboxLimits {key}={value!r} is invalid; expected a number > 0.")
        if self.memory_bytes < 64 << 20:
            raise ValueError(
                f"SandboxLimits memory_bytes={self.memory_bytes} is too small for the interpreter; "
                "expected at least 64 MiB (67108864)."
            )
        if self.max_processes < 2:
            raise ValueError(f"SandboxLimits max_processes={self.max_processes} is invalid; expected >= 2.")


@dataclass
class SandboxResult:
    """What one run left: its stdout (at most ``max_output_bytes``) and how it ended.

    ``returncode`` is the interpreter's exit status (negative: killed by that signal; None when the
    run was killed for its timeout or its output).
    """

    stdout: bytes
    returncode: int | None
    timed_out: bool
    output_truncated: bool
    elapsed_s: float
    stderr: bytes = b""

    @property
    def ok(self) -> bool:
        """The code ran to its end and exited 0, within its time and output limits."""
        return self.returncode == 0 and not self.timed_out and not self.output_truncated


def find_bwrap(bwrap: str = "bwrap") -> str | None:
    """The path of the ``bwrap`` executable (a name looked up on ``PATH``, or a path), or None."""
    return shutil.which(bwrap)


def sandbox_uid(slot: int, base: int = 100_000) -> int:
    """The unprivileged uid a run in ``slot`` gets when the worker is root: one per (worker, slot).

    The process limit counts a uid's processes machine-wide, so two concurrent runs get two uids
    (workers are told apart by their pid; two workers whose pids agree modulo 10,000 share uids).
    """
    return base + (os.getpid() % 10_000) * 64 + slot % 64


def interpreter_prefix(python: str) -> str:
    """The install prefix of the interpreter at ``python`` (``<prefix>/bin/python3``), symlinks resolved."""
    return str(Path(os.path.realpath(python)).parent.parent)


class Sandbox:
    """Runs payloads of :mod:`~unirl_lightning.rewards.sandbox_runner` in ``bwrap`` (see the module).

    Args:
        limits: What each run may use.
        python: The interpreter that runs the code; None = the interpreter running this process
            (its real path, outside any virtual environment: a venv's packages are not bound).
        bwrap: The ``bwrap`` executable, a name on ``PATH`` or a path.
        allow_unsandboxed: Without a usable ``bwrap``, run the code as a plain child process (with a
            loud warning; still rlimits and the timeout) instead of refusing.

    Picklable (plain settings); the first run in a process checks that the sandbox starts, and
    raises :class:`SandboxUnavailableError` with ``bwrap``'s own message when it does not.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        python: str | None = None,
        bwrap: str = "bwrap",
        allow_unsandboxed: bool = False,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.python = os.path.realpath(python or sys.executable)
        self.bwrap = bwrap
        self.allow_unsandboxed = allow_unsandboxed
        self._checked: str | None = None  # "bwrap" or "unsandboxed" once this process checked

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_checked"] = None  # every process checks for itself
        return state

    # -- which way this process runs code -----------------------------------------------------------
    def check(self) -> str:
        """``"bwrap"`` when the sandbox starts here, ``"unsandboxed"`` when it may not and that is
        allowed; raises :class:`SandboxUnavailableError` otherwise (once per process, then cached)."""
        if self._checked is not None:
            return self._checked
        path = find_bwrap(self.bwrap)
        why = f"bwrap={self.bwrap!r} was not found" if path is None else None
        if path is not None:
            probe = self._run(
                self.bwrap_command(path, slot=0),
                {"mode": "stdio", "code": "print('ok')", "stdin": ""},
                slot=0,
            )
            if probe.stdout.strip() != b"ok" or probe.returncode != 0:
                why = (
                    f"{path} could not start a sandbox here (exit {probe.returncode}): "
                    f"{probe.stderr.decode(errors='replace').strip()[:500] or '<no message>'}"
                )
        if why is None:
            self._checked = "bwrap"
        elif self.allow_unsandboxed:
            log.warning(
                "UNSANDBOXED CODE EXECUTION: %s, and allow_unsandboxed is true, so completions run as "
                "plain child processes of pid %d with rlimits and a %.0f s timeout only: they can read "
                "every file this user can, open network connections%s. Install bubblewrap "
                "(apt-get install bubblewrap) to sandbox them.",
                why,
                os.getpid(),
                self.limits.timeout_s,
                ", and (as root) fork without limit" if os.geteuid() == 0 else "",
            )
            self._checked = "unsandboxed"
        else:
            raise SandboxUnavailableError(
                f"Refusing to run model-written code without a sandbox: {why}. Install bubblewrap "
                "(Debian/Ubuntu: apt-get install bubblewrap; `make test` installs it where root and apt "
                "exist), or set allow_unsandboxed: true to run it unsandboxed (rlimits and a timeout only)."
            )
        return self._checked

    def bwrap_command(self, bwrap_path: str, slot: int) -> list[str]:
        """The ``bwrap`` command line of one run (see the module docstring for what it grants)."""
        as_root = os.geteuid() == 0
        args = [bwrap_path, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
        args += ["--unshare-cgroup-try"]
        if not as_root:
            args.append("--unshare-user")
        args += ["--die-with-parent", "--new-session", "--hostname", "sandbox"]
        args += ["--ro-bind", "/usr", "/usr"]
        for top in _TOP_LEVEL:
            if os.path.islink(top):
                args += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                args += ["--ro-bind", top, top]
        prefix = interpreter_prefix(self.python)
        if not (prefix == "/usr" or prefix.startswith("/usr/")):
            parents = list(Path(prefix).parents)[::-1][1:]  # without "/"
            for parent in parents:  # bwrap would make them 0700 (unreadable once the uid drops)
                args += ["--perms", "0755", "--dir", str(parent)]
            args += ["--ro-bind", prefix, prefix]
        args += ["--proc", "/proc", "--dev", "/dev"]
        for tmpfs in ("/tmp", SANDBOX_HOME):
            args += ["--perms", "1777", "--size", str(self.limits.tmpfs_bytes), "--tmpfs", tmpfs]
        args += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp"]
        args += ["--clearenv", "--setenv", "HOME", SANDBOX_HOME, "--setenv", "PATH", "/usr/bin:/bin"]
        args += ["--setenv", "LANG", "C.UTF-8"]
        if as_root:  # only to become the unprivileged uid; setuid() then drops every capability
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        return [*args, "--", self.python, "-I", "-B", "-c", RUNNER_SOURCE]

    # -- one run ------------------------------------------------------------------------------------
    def run(self, payload: dict[str, Any], slot: int = 0) -> SandboxResult:
        """Run one payload (see :mod:`~unirl_lightning.rewards.sandbox_runner`) in slot ``slot``.

        Raises:
            SandboxUnavailableError: no usable sandbox and ``allow_unsandboxed`` is false.
        """
        if self.check() == "bwrap":
            return self._run(self.bwrap_command(find_bwrap(self.bwrap) or self.bwrap, slot), payload, slot)
        with tempfile.TemporaryDirectory(prefix="unirl-unsandboxed-") as home:
            command = [self.python, "-I", "-B", "-c", RUNNER_SOURCE]
            env = {"HOME": home, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
            return self._run(command, payload, slot, cwd=home, env=env, sandboxed=False)

    def _run(
        self,
        command: list[str],
        payload: dict[str, Any],
        slot: int,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        sandboxed: bool = True,
    ) -> SandboxResult:
        limits = self.limits
        payload = {
            **payload,
            "limits": {
                "cpu_time_s": limits.cpu_time_s,
                "memory_bytes": limits.memory_bytes,
                "file_size_bytes": limits.file_size_bytes,
                "max_processes": limits.max_processes,
                "max_open_files": limits.max_open_files,
            },
            "drop_to": [sandbox_uid(slot)] * 2 if sandboxed and os.geteuid() == 0 else None,
        }
        data = json.dumps(payload).encode()
        start = time.monotonic()
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd or "/",
            env=env if env is not None else {},
            start_new_session=True,  # its own process group: the timeout kills all of it
        )
        stdout, stderr = bytearray(), bytearray()
        timed_out = truncated = False
        writer = threading.Thread(target=_feed, args=(proc.stdin, data), daemon=True)
        writer.start()
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ, stdout)
            selector.register(proc.stderr, selectors.EVENT_READ, stderr)
            deadline = start + limits.timeout_s
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                for key, _ in selector.select(timeout=min(left, 0.5)):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    sink = key.data
                    room = (limits.max_output_bytes if sink is stdout else _STDERR_BYTES) - len(sink)
                    sink += chunk[: max(room, 0)]
                    if sink is stdout and len(chunk) > room:
                        truncated = True
                if truncated:
                    break
            if timed_out or truncated:
                _kill_group(proc)
                _drain(selector, _DRAIN_S)
        returncode = None if (timed_out or truncated) else _wait(proc)
        if returncode is None:
            _wait(proc)
        for stream in (proc.stdout, proc.stderr):
            stream.close()
        writer.join(timeout=1.0)
        return SandboxResult(
            stdout=bytes(stdout),
            returncode=returncode,
            timed_out=timed_out,
            output_truncated=truncated,
            elapsed_s=time.monotonic() - start,
            stderr=bytes(stderr),
        )


def _feed(stream: Any, data: bytes) -> None:
    try:
        stream.write(data)
        stream.close()
    except (BrokenPipeError, ValueError, OSError):  # the run ended before reading all of it
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (bwrap: its sandbox init then dies, and the PID namespace)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _drain(selector: selectors.BaseSelector, seconds: float) -> None:
    """Read and drop what is left until every writer of the pipes is gone (EOF), at most ``seconds``."""
    end = time.monotonic() + seconds
    while selector.get_map() and time.monotonic() < end:
        for key, _ in selector.select(timeout=0.1):
            if not os.read(key.fd, 65536):
                selector.unregister(key.fileobj)


def _wait(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:  # a process that outlived its group's kill: kill it again
        _kill_group(proc)
        return proc.wait()
