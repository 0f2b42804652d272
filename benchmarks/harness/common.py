"""What every benchmark shares: its arguments, its child processes and its results file.

* Arguments: :func:`script_parser` (a parser that knows the hidden ``--child <json>`` flag and
  ``--output DIR``, the results folder) and :func:`parse_config` (the parsed flags as the config
  ``run(config)`` takes; with ``--child`` it runs the script's child function in this process instead
  and prints its result).
* Child processes: :func:`run_child` runs one configuration as ``python -m <module> --child <json>``
  in a fresh process (torch threads and Ray start fresh) and reads back the ``RESULT {json}`` line
  (:func:`emit`) it prints last.
* Results: :func:`write_results` writes ``<results folder>/<name>.json`` (or a given path) under the
  envelope (``envelope.py``); :func:`finish` writes it and prints the final JSON line.

The rest of the harness: ``figures.py`` (matplotlib), ``sides.py`` (what both sides of a comparison
with TRL load and score with), ``stats.py`` (timing and spreads), ``processes.py`` (CPU time per
process), ``registry.py`` (every benchmark, its cost and its smoke arguments), ``plot.py``.

Importing this module puts this checkout first on ``sys.path`` and defaults ``RAY_AUTH_MODE`` to
``token``; heavy imports (torch, transformers, the library) happen inside the functions, so
``plot`` and ``--help`` stay cheap.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import envelope
from benchmarks.harness.envelope import BENCH_DIR, REPO, RESULTS, RESULTS_ENV, results_dir, results_path

__all__ = ["BENCH_DIR", "REPO", "RESULTS", "RESULTS_ENV", "results_dir", "results_path"]

RESULT_PREFIX = "RESULT "
# a launcher's rank variables would make a child's Lightning think it is one rank of a running job
LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS")

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_AUTH_MODE", "token")


# -- arguments ---------------------------------------------------------------------------------------
def script_parser(doc: str | None) -> argparse.ArgumentParser:
    """The argument parser of a benchmark: its docstring as the help, ``--output DIR`` (the results
    folder) and the hidden ``--child <json>`` flag a script that re-runs itself per configuration gets
    from :func:`run_child`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument(
        "--output",
        metavar="DIR",
        help=f"folder of the results files (default: ${RESULTS_ENV}, else benchmarks/results)",
    )
    return parser


def parse_config(
    parser: argparse.ArgumentParser,
    argv: list[str] | None = None,
    child: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """The parsed flags as a config dict (``--some-flag`` -> ``some_flag``; ``--child`` and
    ``--output`` left out: ``--output DIR`` becomes ``$UNIRL_BENCH_RESULTS``, which child processes
    inherit).

    With ``--child <json>`` this process is one configuration of the benchmark: ``child(config)``
    runs here (warnings silenced), its result is printed as the ``RESULT`` line :func:`run_child`
    reads (nothing is printed when it returns None, e.g. on the other ranks of a multi-rank child),
    and the process exits."""
    config = vars(parser.parse_args(argv))
    output = config.pop("output", None)
    if output:
        os.environ[RESULTS_ENV] = str(Path(output).resolve())
    child_config = config.pop("child")
    if child_config is None:
        return config
    if child is None:
        parser.error("--child: this benchmark runs no child processes")
    quiet()
    result = child(json.loads(child_config))
    if result is not None:
        emit(result)
    raise SystemExit(0)


# -- child processes ---------------------------------------------------------------------------------
def child_env() -> dict[str, str]:
    """The environment of a child run: this checkout first on the path (Ray workers inherit it, so
    they import the same library and the harness's reward), Ray token auth, quiet HF, no launcher's
    rank variables."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    paths = [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("RAY_AUTH_MODE", "token")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("RAY_DEDUP_LOGS", "0")
    return env


def module_name(script: str | Path) -> str:
    """The dotted module of a benchmark given as its file (``benchmarks/peers/vs_trl.py`` ->
    ``benchmarks.peers.vs_trl``) or already as a module name."""
    path = Path(script)
    if path.suffix != ".py":
        return str(script)
    return ".".join(path.resolve().relative_to(REPO).with_suffix("").parts)


def run_child(script: str | Path, config: dict[str, Any], timeout_s: float = 900.0) -> dict[str, Any]:
    """Run ``python -m <script's module> --child <config>`` in a fresh process; its last ``RESULT``
    line, parsed (with the process's wall time as ``process_s``)."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", module_name(script), "--child", json.dumps(config)],
        env=child_env(),
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).splitlines()[-40:])
        raise RuntimeError(f"child run {config.get('name')} failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["process_s"] = time.perf_counter() - start
    return result


def emit(result: dict[str, Any]) -> None:
    """What a child prints last (read by :func:`run_child`)."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def quiet() -> None:
    """Silence the warnings and progress bars a run would otherwise print."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers", "datasets", "trl"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - cosmetics only
        pass


# -- results -----------------------------------------------------------------------------------------
def write_results(record: dict[str, Any], out: str | Path, indent: int = 2, config: Any = None) -> Path:
    """Write ``record`` under its envelope (``envelope.write_result``) to :func:`results_path`
    ``(out)``; the path."""
    return envelope.write_result(out, record, config, indent=indent)


def finish(
    record: dict[str, Any],
    out: str | Path | None,
    final: Any = None,
    indent: int = 2,
    config: Any = None,
) -> Path | None:
    """Write ``record`` with ``config`` in its envelope (unless ``out`` is None) and print ``final``
    (default: the record) as the last line, one JSON record."""
    path = write_results(record, out, indent, config) if out is not None else None
    print(json.dumps(record if final is None else final))
    return path


def seed_sweep(
    config: dict[str, Any],
    one_run: Callable[[str, int, dict[str, Any], Path], dict[str, Any]],
    summarize: Callable[[list[dict[str, Any]]], dict[str, Any]],
    print_table: Callable[[dict[str, Any]], None],
) -> None:
    """Run ``one_run(mode, seed, config, folder)`` for every seed and mode (the mode order reversed on
    odd seeds, so no mode always runs first), print each run's held-out curve and the summary table,
    and write ``{"summary", "config", "machine", "runs"}`` to ``config["out"]``."""
    from benchmarks.harness import stats

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix=f"{config['out']}-") as tmp:
        for seed in config["seeds"]:
            for mode in config["modes"] if seed % 2 == 0 else config["modes"][::-1]:
                run = one_run(mode, seed, config, Path(tmp))
                runs.append(run)
                print(
                    f"  {mode:<15} seed {seed}: held-out {run['heldout']} ({run['wall_s']:.0f} s)", flush=True
                )
    summary = summarize(runs)
    print_table(summary)
    record = {"summary": summary, "config": {**config, "out": None}, "machine": stats.machine(), "runs": runs}
    write_results(record, config["out"], config=config)
