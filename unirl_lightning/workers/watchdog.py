"""The local Ray's watchdog: nothing of a run outlives its driver, not even after a SIGKILL.

A local Ray started by a run (``ensure_ray``) dies with its driver only in part: the head processes
share the driver's fate and the workers follow in about 2 s, but Ray's dashboard and runtime-env
agents linger about a minute, and the session folder stays behind. ``ensure_ray`` therefore
starts this watchdog in a session of its own, with a pipe on its stdin, right after ``ray.init``.
While the driver lives it remembers, once a second, every descendant of the driver that was not
already there when it started (so the driver's own subprocesses, e.g. other training ranks, are
never touched). When the pipe closes without a word (the driver died, however) it kills the
remembered processes still alive and removes the run's Ray temp folder. A clean shutdown writes
to the pipe first (:func:`stop_watchdog`): then the watchdog only removes the folder.

Run as ``python -m unirl_lightning.workers.watchdog <driver_pid> <ray_temp_dir>``.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys

import psutil


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def start_watchdog(temp_dir: str, spared: list[int]) -> subprocess.Popen:
    """Start the watchdog of this (driver) process and its Ray temp folder ``temp_dir``; ``spared``
    are pids it never kills (the driver's subprocesses from before ``ray.init``)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "unirl_lightning.workers.watchdog",
            str(os.getpid()),
            temp_dir,
            *map(str, spared),
        ],
        stdin=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
    )


def stop_watchdog(watchdog: subprocess.Popen) -> None:
    """A clean shutdown: the watchdog removes the temp folder and kills nothing."""
    try:
        watchdog.stdin.write(b"stop")
        watchdog.stdin.close()
        watchdog.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        watchdog.kill()


def watch(driver_pid: int, temp_dir: str, spared: set[int], interval_s: float = 1.0) -> None:
    me = os.getpid()
    known: dict[int, psutil.Process] = {}
    stdin = sys.stdin.fileno()
    clean = False
    while True:
        for child in _descendants(driver_pid):
            if child.pid != me and child.pid not in spared:
                known.setdefault(child.pid, child)
        readable, _, _ = select.select([stdin], [], [], interval_s)
        if readable:
            data = os.read(stdin, 1 << 16)
            if data:
                clean = True  # the driver is stopping cleanly: wait for the end of the pipe
                continue
            break  # end of file
    if clean:
        shutil.rmtree(temp_dir, ignore_errors=True)
        return
    for process in known.values():
        try:
            process.kill()  # psutil checks the creation time: a reused pid is left alone
        except psutil.Error:
            pass
    psutil.wait_procs(list(known.values()), timeout=5)
    shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2], {int(pid) for pid in sys.argv[3:]})
