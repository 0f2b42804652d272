"""Does interrupting generation at a sync cost learning? Quiesce vs interrupt on the tiny recipe.

    python -m benchmarks.performance.interrupt_learning [--seeds 0 1 2 3 4] [--max-new-tokens 3] [--chunk 1]

Each run is ``unirl-lightning fit --config examples/grpo_tiny.yaml`` as shipped (async,
``max_staleness 1, max_inflight 2``, held-out accuracy on 64 disjoint prompts every 20 steps, 120
steps), in its own process, with ``--seed_everything SEED`` and two changes that make interrupts
happen often: ``max_new_tokens`` 3 (the recipe's 2 tokens rarely span a sync) and
``interrupt_chunk_tokens`` 1; ``--trainer.strategy.init_args.sync_mode`` is ``quiesce`` or
``interrupt``. Both modes run the same settings otherwise; runs are interleaved by seed. Reported
per mode: the held-out accuracy at every evaluation (``eval/accuracy``, from the TensorBoard file),
its median over seeds, the mean of ``rollout/interrupted_samples`` per step, and the fraction of
trained tokens that came from an older policy version (``rollout/token_staleness/1``). Writes
benchmarks/results/interrupt_learning.json.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import common, stats
from unirl_lightning.cli.curves import read_scalars

RECIPE = common.REPO / "examples" / "grpo_tiny.yaml"
MODES = ("quiesce", "interrupt")


def one_run(mode: str, seed: int, config: dict[str, Any], root: Path) -> dict[str, Any]:
    strategy = "--trainer.strategy.init_args."
    command = [
        sys.executable,
        "-m",
        "unirl_lightning.cli",
        "fit",
        "--config",
        str(RECIPE),
        "--seed_everything",
        str(seed),
        f"--model.init_args.max_new_tokens={config['max_new_tokens']}",
        f"{strategy}sync_mode={mode}",
        f"{strategy}interrupt_chunk_tokens={config['chunk']}",
        f"--trainer.logger.init_args.save_dir={root}",
        f"--trainer.logger.init_args.name={mode}_{seed}",
        f"--trainer.default_root_dir={root}",
        "--trainer.enable_progress_bar=false",
    ]
    if config["max_steps"] is not None:
        command.append(f"--trainer.max_steps={config['max_steps']}")
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=common.child_env(), timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} seed {seed} failed:\n{done.stderr[-3000:]}")
    scalars = read_scalars(next((root / f"{mode}_{seed}").iterdir()))

    def mean(key: str) -> float | None:
        values = [v for _, v in scalars.get(key, [])]
        return statistics.fmean(values) if values else None

    return {
        "mode": mode,
        "seed": seed,
        "heldout": [[step, round(v, 4)] for step, v in scalars["eval/accuracy"]],
        "interrupted_samples_per_step": mean("rollout/interrupted_samples") or 0.0,
        "stale_token_fraction": mean("rollout/token_staleness/1") or 0.0,
        "reward_mean_last20": statistics.fmean(v for _, v in scalars["rollout/reward_mean"][-20:]),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        if not mine:
            continue
        curves = [dict((step, value) for step, value in r["heldout"]) for r in mine]
        at_step = {str(step): stats.spread([c[step] for c in curves if step in c]) for step in curves[0]}
        summary[mode] = {
            "seeds": [r["seed"] for r in mine],
            "heldout": at_step,
            "interrupted_samples_per_step": statistics.median(
                r["interrupted_samples_per_step"] for r in mine
            ),
            "stale_token_fraction": statistics.median(r["stale_token_fraction"] for r in mine),
        }
    return summary


def print_table(summary: dict[str, Any]) -> None:
    for mode, row in summary.items():
        cells = ", ".join(
            f"{step}: {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})" for step, s in row["heldout"].items()
        )
        print(
            f"{mode:<10} held-out median (range) at step {cells}; interrupted/step "
            f"{row['interrupted_samples_per_step']:.1f}; stale tokens {row['stale_token_fraction']:.2f}"
        )


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--max-new-tokens", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=1, help="interrupt_chunk_tokens")
    parser.add_argument("--max-steps", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--out", default="interrupt_learning", help="results file (a bare name: in the results folder)"
    )
    common.seed_sweep(common.parse_config(parser), one_run, summarize, print_table)


if __name__ == "__main__":
    main()
