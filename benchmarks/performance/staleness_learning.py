"""What does staleness cost learning? Sync against ``max_staleness`` 1, 2 and 4 with decoupled PPO.

    python -m benchmarks.performance.staleness_learning [--seeds 0 1 2 3 4] [--modes sync stale1 ...]
        [--recipe tiny|streaming|hybrid|dataset|ddp|fsdp|guessing|reward_model] [--max-new-tokens 2]
        [--max-steps N] [--mini-batches 1]
        [--lr 0.003] [--out staleness_learning]

Each run is ``unirl-lightning fit --config examples/grpo_tiny.yaml`` (held-out accuracy on 64 disjoint
prompts every 20 steps, 120 steps), in its own process, with ``--seed_everything SEED`` and the
mode's strategy and loss settings:

* ``sync``: ``max_staleness 0, max_inflight 1`` (on-policy, the ratio against the rollout log-probs);
* ``staleK`` (K = 1, 2, 4): ``max_staleness K, max_inflight K + 1``, ``old_logprob: recompute`` and
  ``tis_cap: 2`` (decoupled PPO: the ratio against the trainer's own log-probs before the step, the
  behaviour / proximal gap corrected by truncated importance sampling);
* ``staleK_rollout`` (K = 1, 2, 4): the same bound with the ratio against the rollout log-probs (no
  correction; ``stale1_rollout`` is grpo_tiny.yaml as shipped, ``stale2_rollout`` grpo_tiny_streaming.yaml).

``--recipe streaming`` runs ``examples/grpo_tiny_streaming.yaml`` instead (the same task and model; the
HF engine batches continuously, every prompt's group is a launch of its own, and a sync pushes without
draining), with the engine's calls and rows scaled to the mode's window: ``concurrent_calls`` =
``max_inflight`` x 16 groups, ``max_batch_size`` = that x 8 samples (as the recipe sizes them).

``--recipe hybrid`` (``grpo_tiny_hybrid.yaml``: the engine in the training process, no Ray; sync
only, so ``--modes sync``) and ``--recipe dataset`` (``grpo_tiny_dataset.yaml``: the task from a
dataset folder, TRL-style reward functions; ``stale1_rollout`` is the recipe as shipped) check a
rate on the other tiny recipes, as do ``--recipe ddp`` and ``fsdp`` (``grpo_tiny_ddp.yaml``,
``grpo_tiny_fsdp.yaml``: 2 ranks of 8 prompts), ``--recipe guessing`` (``agentic_guessing_tiny.yaml``:
held-out games won every 100 of 300 steps) and ``--recipe reward_model``
(``grpo_tiny_reward_model.yaml``: held-out accuracy every 20 steps, and the math-verify part of the
training reward over the last 20 steps, which tells whether the task or the reward model was
learned), each with ``--modes stale1_rollout`` (as shipped).

``--max-new-tokens`` lengthens completions (the recipe's 2 tokens end every sample at once; a longer
budget gives the untrained policy long, uneven samples: the long-tail case). ``--mini-batches K`` cuts
each step's batch into K optimizer steps (the recipes take one): from the second mini-batch on the
trainer's policy has moved past the proximal one, which is where decoupled PPO's ratio and clip act
(AdamW moves a weight about ``lr`` per optimizer step, so ``--lr`` at the recipe's / K keeps a
step's movement).
Runs are interleaved by seed. Reported per mode: held-out accuracy at every evaluation (median and
range over seeds), the wall seconds at which each evaluation was logged (TensorBoard's own wall time,
from the run's first event), and the fraction of trained tokens older than the step's version. Writes
benchmarks/results/staleness_learning.json.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import common, stats

RECIPES = {
    "tiny": "grpo_tiny.yaml",
    "streaming": "grpo_tiny_streaming.yaml",
    "hybrid": "grpo_tiny_hybrid.yaml",
    "dataset": "grpo_tiny_dataset.yaml",
    "ddp": "grpo_tiny_ddp.yaml",
    "fsdp": "grpo_tiny_fsdp.yaml",
    "guessing": "agentic_guessing_tiny.yaml",
    "reward_model": "grpo_tiny_reward_model.yaml",
}
GROUPS, SAMPLES = 16, 8  # every recipe's batch_size and num_generations
DECOUPLED = {"model.init_args.old_logprob": "recompute", "model.init_args.tis_cap": "2.0"}
MODES: dict[str, dict[str, str]] = {
    "sync": {"max_staleness": "0", "max_inflight": "1"},
    "stale1": {"max_staleness": "1", "max_inflight": "2", **DECOUPLED},
    "stale2": {"max_staleness": "2", "max_inflight": "3", **DECOUPLED},
    "stale4": {"max_staleness": "4", "max_inflight": "5", **DECOUPLED},
    "stale1_rollout": {"max_staleness": "1", "max_inflight": "2"},
    "stale2_rollout": {"max_staleness": "2", "max_inflight": "3"},
    "stale4_rollout": {"max_staleness": "4", "max_inflight": "5"},
}


def overrides(mode: str, recipe: str = "tiny") -> list[str]:
    """The CLI arguments of ``mode`` (strategy keys bare, others with their full path); on the streaming
    recipe, the engine's calls and rows too, sized to the mode's ``max_inflight``."""
    strategy = "--trainer.strategy.init_args."
    args = [
        f"--{key}={value}" if "." in key else f"{strategy}{key}={value}" for key, value in MODES[mode].items()
    ]
    if recipe == "streaming":
        calls = int(MODES[mode]["max_inflight"]) * GROUPS
        engine = f"{strategy}engine.init_args."
        args += [f"{engine}concurrent_calls={calls}", f"{engine}max_batch_size={calls * SAMPLES}"]
    return args


def read_events(log_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Every scalar tag under ``log_dir`` as ``[(step, value, wall_time), ...]`` in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events: dict[str, list[tuple[int, float, float]]] = {}
    for path in sorted(log_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            events.setdefault(tag, []).extend((e.step, e.value, e.wall_time) for e in acc.Scalars(tag))
    return {tag: sorted(values) for tag, values in events.items()}


def one_run(mode: str, seed: int, config: dict[str, Any], root: Path) -> dict[str, Any]:
    name = f"{mode}_{seed}"
    command = [
        sys.executable, "-m", "unirl_lightning.cli", "fit",
        "--config", str(common.REPO / "examples" / RECIPES[config["recipe"]]),
        "--seed_everything", str(seed),
        f"--trainer.logger.init_args.save_dir={root}", f"--trainer.logger.init_args.name={name}",
        f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false",
        *overrides(mode, config["recipe"]),
    ]  # fmt: skip
    if config["max_new_tokens"] is not None:
        command.append(f"--model.init_args.max_new_tokens={config['max_new_tokens']}")
    if config["max_steps"] is not None:
        command.append(f"--trainer.max_steps={config['max_steps']}")
    if config.get("mini_batches") is not None:
        command.append(f"--model.init_args.mini_batches={config['mini_batches']}")
    if config.get("lr") is not None:
        command.append(f"--model.init_args.lr={config['lr']}")
    started = time.perf_counter()
    done = subprocess.run(
        command, capture_output=True, text=True, env=common.child_env(), timeout=1800, cwd=common.REPO
    )  # the dataset recipe names its files from the repository root
    if done.returncode != 0:
        raise RuntimeError(f"{mode} seed {seed} failed:\n{done.stderr[-3000:]}")
    events = read_events(root / name)
    first = min(wall for values in events.values() for _, _, wall in values)
    stale = [v for _, v, _ in events.get("rollout/token_staleness/0", [])]
    math = events.get("rollout/reward/math_verify_mean", [])
    return {
        "mode": mode,
        "seed": seed,
        "heldout": [
            [step, round(value, 4), round(wall - first, 1)]
            for step, value, wall in events.get("eval/accuracy", [])
        ],
        "stale_token_fraction": 1.0 - statistics.fmean(stale) if stale else None,
        "reward_mean_last20": statistics.fmean(v for _, v, _ in events["rollout/reward_mean"][-20:]),
        "math_reward_last20": statistics.fmean(v for _, v, _ in math[-20:]) if math else None,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        if not mine:
            continue
        steps = [step for step, _, _ in mine[0]["heldout"]]

        def at(step: int, field: int, runs_of_mode=mine) -> list[float]:
            return [point[field] for r in runs_of_mode for point in r["heldout"] if point[0] == step]

        stale = [r["stale_token_fraction"] for r in mine if r["stale_token_fraction"] is not None]
        math = [r["math_reward_last20"] for r in mine if r.get("math_reward_last20") is not None]
        summary[mode] = {
            "seeds": [r["seed"] for r in mine],
            "heldout": {str(step): stats.spread(at(step, 1)) for step in steps},
            "seconds": {str(step): statistics.median(at(step, 2)) for step in steps},
            "stale_token_fraction": statistics.median(stale) if stale else None,
            "reward_last20": stats.spread([r["reward_mean_last20"] for r in mine]),
            "math_reward_last20": stats.spread(math) if math else None,
            "wall_s": statistics.median(r["wall_s"] for r in mine),
        }
    return summary


def print_table(summary: dict[str, Any]) -> None:
    for mode, row in summary.items():
        cells = ", ".join(
            f"{step} ({row['seconds'][step]:.1f} s): {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"
            for step, s in row["heldout"].items()
        )
        stale = row["stale_token_fraction"]
        math = row.get("math_reward_last20")
        print(
            f"{mode:<15} held-out at step (s): {cells or '-'}; stale tokens "
            f"{stale if stale is None else round(stale, 2)}; training reward, last 20 steps "
            f"{row['reward_last20']['median']:.3f}"
            + (
                f"; math-verify part {math['median']:.3f} ({math['min']:.3f}-{math['max']:.3f})"
                if math
                else ""
            )
        )


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--recipe", choices=list(RECIPES), default="tiny", help="examples/grpo_tiny*.yaml")
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="default: the recipe's (2; 1 a turn)"
    )
    parser.add_argument("--max-steps", type=int, default=None, help="default: the recipe's")
    parser.add_argument(
        "--mini-batches", type=int, default=None, help="optimizer steps per batch (default: the recipe's, 1)"
    )
    parser.add_argument("--lr", type=float, default=None, help="default: the recipe's")
    parser.add_argument(
        "--out", default="staleness_learning", help="results file (a bare name: in the results folder)"
    )
    common.seed_sweep(common.parse_config(parser), one_run, summarize, print_table)


if __name__ == "__main__":
    main()
