"""The bubblewrap sandbox: what the code sees, the process limit (as root and as a plain user), the
refusal without bwrap, and the unsandboxed mode's warning and limits."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unirl_lightning.rewards.sandbox import (
    Sandbox,
    SandboxLimits,
    SandboxUnavailableError,
    interpreter_prefix,
)

REPO = Path(__file__).resolve().parents[2]


def _sandbox_works() -> bool:
    try:
        return Sandbox().check() == "bwrap"
    except SandboxUnavailableError:
        return False


needs_bwrap = pytest.mark.skipif(
    not _sandbox_works(), reason="bubblewrap is not installed or cannot sandbox here (make test installs it)"
)

FORK_COUNT = """import os, time
def f(x):
    forked = 0
    while forked < 500:
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        forked += 1
    return [forked, os.getuid()]
"""


def call(sandbox: Sandbox, code: str, *inputs: list) -> list:
    """The values (or errors) ``f`` gave for each input, read off the run's result lines."""
    result = sandbox.run(
        {"mode": "call", "code": code, "entry_point": "f", "inputs": list(inputs), "tag": "@T"}
    )
    entries = [json.loads(line[3:]) for line in result.stdout.decode().splitlines() if line.startswith("@T ")]
    return [entry.get("value", entry.get("error")) for entry in entries]


@needs_bwrap
def test_the_process_limit_holds_inside_the_sandbox_and_the_code_is_not_root():
    [(forked, uid)] = call(Sandbox(SandboxLimits(max_processes=8, timeout_s=10)), FORK_COUNT, [0])
    assert 1 <= forked <= 7  # the runner is one of the 8
    assert uid != 0


@needs_bwrap
def test_the_sandbox_sees_no_host_path_but_usr_and_the_interpreter():
    code = """import os, socket
def f(repo):
    seen = {"root": sorted(os.listdir("/")), "home": os.environ.get("HOME"), "env": sorted(os.environ)}
    for path in ("/etc", "/etc/shadow", "/etc/passwd", repo, "/work", "/var", "/sys"):
        seen[path] = os.path.exists(path)
    for path in ("/x", "/usr/x", os.environ["HOME"] + "/x", "/tmp/x"):
        try:
            open(path, "w").write("x")
            seen["wrote " + path] = True
        except OSError:
            seen["wrote " + path] = False
    seen["interfaces"] = sorted(name for _, name in socket.if_nameindex())
    return seen
"""
    [seen] = call(Sandbox(), code, [str(REPO)])
    assert set(seen["root"]) <= {
        "bin",
        "dev",
        "home",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "proc",
        "sbin",
        "tmp",
        "usr",
    } | {Path(interpreter_prefix(sys.executable)).parts[1]}
    assert not any(
        seen[path] for path in ("/etc", "/etc/shadow", "/etc/passwd", str(REPO), "/work", "/var", "/sys")
    )
    assert seen["home"] == "/home/sandbox" and seen["env"] == ["HOME", "LANG", "PATH", "PWD"]
    assert (seen["wrote /x"], seen["wrote /usr/x"]) == (False, False)  # the root is read-only
    assert (seen["wrote /home/sandbox/x"], seen["wrote /tmp/x"]) == (True, True)  # its own tmpfs
    assert seen["interfaces"] == ["lo"]  # an empty network namespace


@needs_bwrap
def test_output_is_read_up_to_the_cap_and_the_run_is_killed_there():
    code = "import sys\nwhile True:\n    sys.stdout.write('y' * 65536)\n"
    result = Sandbox(SandboxLimits(max_output_bytes=100_000, timeout_s=10)).run(
        {"mode": "stdio", "code": code}
    )
    assert result.output_truncated and not result.ok
    assert len(result.stdout) == 100_000 and result.elapsed_s < 10


@needs_bwrap
def test_a_plain_user_gets_the_same_limits_through_a_user_namespace(tmp_path):
    """Run the sandbox as uid 65534 with the system interpreter (the unprivileged bwrap path)."""
    if os.geteuid() != 0 or not shutil.which("setpriv") or not Path("/usr/bin/python3").exists():
        pytest.skip("needs root (to become another user), setpriv and /usr/bin/python3")
    script = (
        "import importlib.util, sys, json\n"
        f"spec = importlib.util.spec_from_file_location('sb', {str(REPO / 'unirl_lightning/rewards/sandbox.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['sb'] = m; spec.loader.exec_module(m)\n"
        "s = m.Sandbox(m.SandboxLimits(max_processes=8), python='/usr/bin/python3')\n"
        f"r = s.run({{'mode': 'call', 'code': {FORK_COUNT!r}, 'entry_point': 'f', 'inputs': [[0]], 'tag': '@T'}})\n"
        "print(s.check(), r.stdout.decode().split('@T ')[1])\n"
    )
    out = subprocess.run(
        [
            "setpriv",
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            script,
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    if "setting up uid map" in out.stderr or "No permissions" in out.stderr:
        pytest.skip(f"unprivileged user namespaces are off here: {out.stderr.strip()[:200]}")
    mode, entry = out.stdout.split(" ", 1)
    forked, uid = json.loads(entry)["value"]
    assert mode == "bwrap" and uid == 65534
    assert 1 <= forked <= 6  # the runner and bwrap's init count too, inside the namespace


def test_without_bwrap_it_refuses_and_names_the_fix():
    with pytest.raises(SandboxUnavailableError, match="bwrap='/nonexistent/bwrap' was not found") as info:
        Sandbox(bwrap="/nonexistent/bwrap").check()
    assert "apt-get install bubblewrap" in str(info.value) and "allow_unsandboxed: true" in str(info.value)


def test_a_bwrap_that_cannot_start_a_sandbox_is_refused_with_its_exit_status():
    with pytest.raises(SandboxUnavailableError, match=r"could not start a sandbox here \(exit 1\)"):
        Sandbox(bwrap=shutil.which("false") or "/bin/false").check()


def test_unsandboxed_runs_warn_loudly_and_keep_the_timeout_and_the_rlimits(caplog):
    sandbox = Sandbox(
        SandboxLimits(timeout_s=2, cpu_time_s=1, memory_bytes=256 << 20),
        bwrap="/nonexistent/bwrap",
        allow_unsandboxed=True,
    )
    with caplog.at_level(logging.WARNING, logger="unirl_lightning.rewards.sandbox"):
        assert sandbox.check() == "unsandboxed"
    assert "UNSANDBOXED CODE EXECUTION" in caplog.text and "apt-get install bubblewrap" in caplog.text
    start = time.monotonic()
    looping = sandbox.run({"mode": "stdio", "code": "while True:\n    pass\n"})
    assert not looping.ok and time.monotonic() - start < 10
    assert call(sandbox, "def f(n):\n    return len(bytearray(n))\n", [1 << 30], [1000]) == [
        "MemoryError: ",
        1000,
    ]
