"""Who uses the cores while a synchronous step generates: every process's CPU time during the worker's
``generate`` calls of a real run.

    python benchmarks/generation_cpu_share.py [--steps 4] [--stopping natural|suppressed]

Runs ``vs_trl.py``'s ``sync-2t`` configuration on the SmolLM2 workload (full fine-tuning, one rollout
worker, 2 torch threads on each side, taking turns) in a child process while this process samples
every process's CPU time (user + system) and title at 5 Hz. A generation window is a run of samples in
which a process is titled ``ray::RolloutWorker.generate`` (Ray's title while the call runs); per
process, the CPU seconds used between the first and last sample of each window are summed. With
nothing competing, the worker's share of ``cores x window`` is what ``generate`` itself can use (its
Python between the kernels runs on one thread), and the trainer process (blocked in ``ray.wait``)
uses next to nothing.

Prints the table and a JSON line; writes ``benchmarks/results/generation_cpu_share.json``.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import common

GENERATE_TITLE = "RolloutWorker.generate"
PERIOD_S = 0.2


def snapshot() -> dict[str, Any]:
    import psutil

    rows = {}
    for proc in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
        times = proc.info["cpu_times"]
        if times is None:
            continue
        title = " ".join(proc.info["cmdline"] or []) or proc.info["name"] or "?"
        rows[proc.info["pid"]] = (title.strip(), times.user + times.system)
    return {"t": time.time(), "rows": rows}


def windows(snaps: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """``(first, last)`` sample indices of each run of samples in which some process is generating."""
    found, start = [], None
    for i, snap in enumerate(snaps):
        busy = any(GENERATE_TITLE in title for title, _ in snap["rows"].values())
        if busy and start is None:
            start = i
        elif not busy and start is not None:
            found.append((start, i - 1))
            start = None
    return [(a, b) for a, b in found if b - a >= 2]  # at least 0.4 s: a real call, not a title flicker


def label(title: str, me: int, pid: int) -> str:
    if pid == me:
        return "this sampler"
    if GENERATE_TITLE in title or title.startswith("ray::RolloutWorker"):
        return "rollout worker"
    if "vs_trl.py --child" in title:
        return "trainer (the run's process)"
    if title.startswith("ray::") or "/ray/" in title or "raylet" in title or "gcs_server" in title:
        return "Ray's own processes"
    return "other"


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Sample every process's CPU time while a ``vs_trl.py`` sync-2t SmolLM2 run goes; the CPU seconds
    per kind of process summed over the generation windows."""
    snaps: list[dict[str, Any]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            t0 = time.time()
            snaps.append(snapshot())
            done.wait(max(0.0, PERIOD_S - (time.time() - t0)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with tempfile.TemporaryDirectory(prefix="cpu-share-") as out:
        cmd = [
            sys.executable,
            str(common.BENCH_DIR / "vs_trl.py"),
            "--workloads", "smollm2", "--configs", "sync-2t", "--runs", "1", "--warmup", "1",
            "--steps-long", str(config["steps"]), "--stopping", config["stopping"], "--out", str(Path(out) / "run.json"),
        ]  # fmt: skip
        subprocess.run(cmd, check=True, env=common.child_env(), stdout=subprocess.DEVNULL)
    done.set()
    sampler.join()
    me = os.getpid()
    per: collections.Counter[str] = collections.Counter()
    wall = 0.0
    spans = windows(snaps)
    for a, b in spans:
        first, last = snaps[a]["rows"], snaps[b]["rows"]
        wall += snaps[b]["t"] - snaps[a]["t"]
        for pid, (title, cpu) in last.items():
            if pid in first:
                per[label(title, me, pid)] += cpu - first[pid][1]
    cores = os.cpu_count() or 1
    return {
        "machine": common.machine(),
        "stopping": config["stopping"],
        "windows": len(spans),
        "generation_wall_s": round(wall, 2),
        "cpu_s": {name: round(v, 2) for name, v in per.most_common()},
        "worker_share_of_cores": round(per["rollout worker"] / (cores * wall), 3) if wall else None,
    }


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--stopping", default="natural", choices=["natural", "suppressed"])
    parser.add_argument("--out", default=str(common.results_path("generation_cpu_share")))
    config = common.parse_config(parser)
    results = run(config)
    print(
        f"{results['windows']} generation windows, {results['generation_wall_s']:.1f} s of wall time "
        f"on {os.cpu_count() or 1} cores"
    )
    for name, value in results["cpu_s"].items():
        print(f"{name:<30} {value:6.2f} CPU-s")
    common.finish(results, config["out"], {k: v for k, v in results.items() if k != "machine"}, indent=1)


if __name__ == "__main__":
    main()
