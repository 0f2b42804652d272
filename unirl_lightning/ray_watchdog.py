"""The local Ray's watchdog: nothing of a run outlives its driver, not even after a SIGKILL.

A local Ray started by a run (``ensure_ray``) dies with its driver only in part: the head processes
share the driver's fate and the workers follow in about 2 s, but Ray's dashboard and runtime-env
agents linger about a minute, and the session folder stays behind. ``ensure_ray`` therefore
starts this watchdog in a session of its own, with a pipe on its stdin. While the driver lives it
remembers every descendant of the driver once a second; when the pipe closes (the driver is gone,
however it ended) it kills the remembered processes still alive and removes the run's Ray temp
folder. After a clean ``ray.shutdown()`` there is nothing left to kill, and the folder goes.

Run as ``python -m unirl_lightning.ray_watchdog <driver_pid> <ray_temp_dir>``.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys

import psutil


def start_watchdog(temp_dir: str) -> subprocess.Popen:
    """Start the watchdog of this (driver) process and its Ray temp folder ``temp_dir``."""
    return subprocess.Popen(
        [sys.executable, "-m", "unirl_lightning.ray_watchdog", str(os.getpid()), temp_dir],
        stdin=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
    )


def watch(driver_pid: int, temp_dir: str, interval_s: float = 1.0) -> None:
    me = os.getpid()
    known: dict[int, psutil.Process] = {}
    stdin = sys.stdin.fileno()
    while True:
        try:
            for child in psutil.Process(driver_pid).children(recursive=True):
                if child.pid != me:
                    known.setdefault(child.pid, child)
        except psutil.Error:
            pass
        readable, _, _ = select.select([stdin], [], [], interval_s)
        if readable and not os.read(stdin, 1 << 16):
            break  # end of file: the driver is gone
    for process in known.values():
        try:
            process.kill()  # psutil checks the creation time: a reused pid is left alone
        except psutil.Error:
            pass
    psutil.wait_procs(list(known.values()), timeout=5)
    shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2])
