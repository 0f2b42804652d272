"""The program that runs inside the sandbox: it lowers its own limits, then runs one solution.

Contract: standard library only, and self-contained: :mod:`unirl_lightning.rewards.sandbox` passes
this file's source to the interpreter as ``python -I -B -c <source>`` (so no host path holds it in
the sandbox) and writes one JSON payload on its stdin::

    {"limits": {"cpu_time_s": 5, "memory_bytes": ..., "file_size_bytes": ..., "max_processes": 32,
                "max_open_files": 64},
     "drop_to": [uid, gid] | null,          # set when the sandbox starts as root: run as this uid
     "mode": "call" | "stdio",
     "code": "<the solution's source>",
     "entry_point": "f",                    # mode "call": the function each input is passed to
     "inputs": [[arg, ...], ...],           # mode "call": one argument list per test
     "stdin": "<text>",                     # mode "stdio": the program's standard input
     "tag": "<random string>"}              # mode "call": marks the result lines

It drops privileges first (root only), then sets the rlimits (``RLIMIT_NPROC`` is set here, inside
the sandbox's user namespace, so it counts the sandbox's processes only), then runs the code:

* ``"call"``: ``exec`` the code as module ``solution``, then call ``entry_point(*args)`` for each
  input and write one line ``<tag> {"index": i, "value": <JSON of the result>}`` (or ``"error"``)
  per test on stdout. Expected outputs never enter the sandbox: the host compares the values, so a
  solution can forge a result line only with the right value.
* ``"stdio"``: run the code as ``__main__`` with ``stdin`` as its standard input; the host compares
  what it printed. Exit status 0 when the program ended normally, 1 when it raised.
"""

import json
import os
import resource
import sys
import tempfile
import traceback


def _lower(limit: int, value: int) -> None:
    soft, hard = resource.getrlimit(limit)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(limit, (value, value))


def apply_limits(limits: dict) -> None:
    """Lower this process's rlimits (inherited by everything it starts)."""
    cpu = int(limits["cpu_time_s"])
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    # SIGXCPU at the soft limit, SIGKILL one second later
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1 if hard == resource.RLIM_INFINITY else hard))
    _lower(resource.RLIMIT_AS, int(limits["memory_bytes"]))
    _lower(resource.RLIMIT_FSIZE, int(limits["file_size_bytes"]))
    _lower(resource.RLIMIT_NPROC, int(limits["max_processes"]))
    _lower(resource.RLIMIT_NOFILE, int(limits["max_open_files"]))
    _lower(resource.RLIMIT_CORE, 0)


def drop_privileges(uid: int, gid: int) -> None:
    """Become ``uid``/``gid`` (from root): the process limit then applies, and every capability goes."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def run_calls(payload: dict, out: int) -> int:
    tag = payload["tag"]

    def emit(entry: dict) -> None:
        os.write(out, ("\n" + tag + " " + json.dumps(entry) + "\n").encode())

    namespace = {"__name__": "solution"}
    try:
        exec(compile(payload["code"], "<solution>", "exec"), namespace)
        function = namespace[payload["entry_point"]]
    except BaseException as err:  # noqa: BLE001 - the solution's own failure is a result
        emit({"index": -1, "error": f"{type(err).__name__}: {err}"})
        return 1
    for index, args in enumerate(payload["inputs"]):
        try:
            value = json.loads(json.dumps(function(*args)))
        except BaseException as err:  # noqa: BLE001
            emit({"index": index, "error": f"{type(err).__name__}: {err}"})
            continue
        emit({"index": index, "value": value})
    return 0


def run_program(payload: dict) -> int:
    fd, path = tempfile.mkstemp()
    with os.fdopen(fd, "w") as handle:
        handle.write(payload.get("stdin", ""))
    stdin = open(path)  # noqa: SIM115 - the program's standard input until it exits
    os.dup2(stdin.fileno(), 0)
    sys.stdin = stdin
    try:
        exec(compile(payload["code"], "<solution>", "exec"), {"__name__": "__main__"})
    except SystemExit as exit_:
        return 0 if exit_.code in (None, 0) else 1
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
    return 0


def main() -> int:
    payload = json.loads(sys.stdin.buffer.read())
    if payload.get("drop_to"):
        drop_privileges(*payload["drop_to"])
    apply_limits(payload["limits"])
    if payload["mode"] == "call":
        return run_calls(payload, os.dup(1))
    return run_program(payload)


if __name__ == "__main__":
    sys.exit(main())
