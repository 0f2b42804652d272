"""Learning on the real model, ours vs TRL, over seeds: ``examples/grpo_smollm2_cpu.yaml`` (issue 25).

    python -m benchmarks.peers.smollm2_learning [--seeds 0 1] [--configs async sync trl] [--quick]
    python -m benchmarks.peers.smollm2_learning --recipe reasoning_gym --seeds 0 1 2 3 4 --configs async trl

``--recipe reasoning_gym`` trains ``examples/grpo_smollm2_reasoning_gym.yaml`` instead (a reasoning-gym
task scored by its own verifier, issue 50) on both sides, with everything below the same; its results
go to ``smollm2_reasoning_gym.json``.

The SmolLM2-135M-Instruct LoRA recipe (word problems, math-verify + 0.1 format reward, chat template,
natural stopping at ``<|im_end|>``, 2 prompts x 8 samples x up to 64 new tokens per step, temperature
0.6, lr 4e-4, 18 steps, greedy held-out accuracy on 64 unseen problems every 6 steps), trained by:

* ``async``: ours exactly as ``unirl-lightning fit --config examples/grpo_smollm2_cpu.yaml`` runs it
  (in-process through the same CLI entry point, ``--seed_everything <seed>``): ``max_staleness: 1``,
  ``advantage: dr_grpo`` (rewards minus the group mean, not divided by the group's std);
* ``sync``: the same with ``max_staleness: 0, max_inflight: 1``;
* ``async-grpo`` / ``sync-grpo``: the same with ``advantage: grpo`` (divided by the group's std, the
  recipe's setting before this benchmark found it collapsing on one seed of two);
* ``trl``: TRL ``GRPOTrainer`` built from the SAME parsed recipe: the module the CLI instantiates
  gives the model (SmolLM2 with the same LoRA adapters on the same modules, dropout off), the
  tokenizer, the reward object and the sampling settings; the datamodule gives the same 256
  training and 64 held-out records. TRL renders the prompts with the same chat template (as
  conversational prompts), ``beta=0``, ``loss_type="dapo"`` (its default: the global token mean,
  ours too), ``scale_rewards`` from the module's ``advantage`` (``dr_grpo``: ``"none"``, ``grpo``:
  ``"group"``), ``epsilon=0.2``, one generation per optimizer step, AdamW lr 4e-4 constant, weight
  decay 0, gradient norm 1.0, float32 (``bf16=False``: GRPOConfig's default ``bf16=True`` trains
  under bf16 autocast, also on CPU), no activation checkpointing (its default is on), all cores'
  torch threads (TRL's default). Its held-out evaluation is a callback with the recipe's rule:
  greedy, 64 new tokens, stop at the end-of-turn token, the recipe's reward, correct when the reward
  is >= 1.0 (``accuracy_threshold: 1.0``);
* ``trl-same-order``: ``trl`` on our prompt stream: the rows in the order our loop draws them (the
  data module's first pass under its own seed, the same for every ``--seed``), TRL's shuffling off,
  so step k trains on the same two prompts on both sides;
* ``trl-grpo``: TRL with ``advantage: grpo`` (``scale_rewards="group"``, TRL's default);
  ``trl-grpo-defaults``: that with GRPOConfig's defaults for precision and memory (``bf16=True``,
  ``gradient_checkpointing=True``);
* the options against ``async``'s one step of staleness, ours only: ``async-recompute``
  (``old_logprob: recompute``: decoupled PPO, the ratio taken against the trainer's own log-probs of
  the batch before its update, the proximal policy), ``async-tis`` (that with ``tis_cap: 2.0``: each
  token also reweighted by its truncated importance weight against the engine's log-probs) and
  ``async-inflight1`` (``max_staleness: 1`` with ``max_inflight: 1``: one generation in flight, the
  next one overlapping this step's training).

Both sides score the untrained model first (step 0), so the two evaluations are checked against each
other: they must agree there. Times are wall-clock from the start of the run's process (model
loading and the four evaluations included). ``rollout/reward/*`` (ours) and TRL's per-step reward
parts are recorded, so a run that collapses into the format bonus (boxed wrong answers: the format
part near 1, the correctness part near 0) is visible. Each run is its own process; results go to
``benchmarks/results/smollm2_learning.json`` and the plot (held-out accuracy against wall time and
against steps, median and range over seeds) to ``benchmarks/results/smollm2_learning.png``. TRL's
side is in ``smollm2_trl.py``.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

START = time.perf_counter()

from benchmarks.harness import common, figures, stats  # noqa: E402
from benchmarks.peers import smollm2_trl  # noqa: E402

RECIPES = {  # --recipe: the recipe both sides train, and its results file
    "word_problems": ("grpo_smollm2_cpu.yaml", "smollm2_learning"),
    "reasoning_gym": ("grpo_smollm2_reasoning_gym.yaml", "smollm2_reasoning_gym"),
}


def recipe_path(cfg: dict[str, Any]) -> Path:
    return common.REPO / "examples" / RECIPES[cfg.get("recipe", "word_problems")][0]


GRPO_ADVANTAGE = ["--model.init_args.advantage", "grpo"]
SYNC = ["--trainer.strategy.init_args.max_staleness", "0", "--trainer.strategy.init_args.max_inflight", "1"]
RECOMPUTE = ["--model.init_args.old_logprob", "recompute"]
CONFIGS: dict[str, list[str]] = {  # extra CLI arguments, given to the recipe on both sides
    "async": [],
    "sync": SYNC,
    "async-grpo": GRPO_ADVANTAGE,
    "sync-grpo": [*SYNC, *GRPO_ADVANTAGE],
    "trl": [],
    "trl-grpo": GRPO_ADVANTAGE,
    "trl-grpo-defaults": GRPO_ADVANTAGE,  # and GRPOConfig's defaults bf16=True, gradient checkpointing
    "trl-same-order": [],  # TRL on our prompt stream: the same prompts at the same steps as ours
    # the options against the async side's one step of staleness (ours only)
    "async-recompute": RECOMPUTE,
    "async-tis": [*RECOMPUTE, "--model.init_args.tis_cap", "2.0"],
    "async-inflight1": ["--trainer.strategy.init_args.max_inflight", "1"],
}
TRL_SIDES = ("trl", "trl-grpo", "trl-grpo-defaults", "trl-same-order")


# -- ours ------------------------------------------------------------------------------------------
def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Every scalar of a TensorBoard run folder: tag -> [(step, value, wall_time)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: [(e.step, e.value, e.wall_time) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def child_ours(cfg: dict[str, Any]) -> dict[str, Any]:
    from unirl_lightning.cli.verbs import main

    wall0 = time.time() - (time.perf_counter() - START)  # the process's start on the event clock
    with tempfile.TemporaryDirectory(prefix="smollm2-") as out:
        args = ["fit", "--config", str(recipe_path(cfg)), "--seed_everything", str(cfg["seed"])]
        args += ["--trainer.logger.init_args.save_dir", out, "--trainer.max_steps", str(cfg["steps"])]
        args += ["--trainer.enable_progress_bar", "false", *CONFIGS[cfg["name"]]]
        main(args)
        (log_dir,) = Path(out).glob("*/version_*")
        scalars = read_scalars(log_dir)
    evals = [
        {"step": step, "t": round(wall - wall0, 1), "heldout_accuracy": round(value, 4)}
        for step, value, wall in scalars["eval/accuracy"]
    ]
    parts = {
        tag: [round(v, 4) for _, v, _ in rows]
        for tag, rows in scalars.items()
        if tag.startswith("rollout/reward")
    }
    tokens = [v for _, v, _ in scalars.get("rollout/completion_tokens", [])]
    return {"evals": evals, "train_rewards": parts, "completion_tokens_per_step": tokens}


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg["name"] in TRL_SIDES:
        recipe = [
            "--config",
            str(recipe_path(cfg)),
            "--seed_everything",
            str(cfg["seed"]),
            *CONFIGS[cfg["name"]],
        ]
        result = smollm2_trl.child_trl(cfg, recipe, START)
    else:
        result = child_ours(cfg)
    return {
        "name": cfg["name"],
        "seed": cfg["seed"],
        "wall_s": round(time.perf_counter() - START, 1),
        **result,
    }


# -- the driver ----------------------------------------------------------------------------------
def summarize(runs: list[dict[str, Any]], configs: list[str]) -> dict[str, Any]:
    summary = {}
    for name in configs:
        mine = [r for r in runs if r["name"] == name]
        if not mine:
            continue
        final = [r["evals"][-1]["heldout_accuracy"] for r in mine]
        summary[name] = {
            "seeds": [r["seed"] for r in mine],
            "final_heldout": stats.spread(final),
            "start_heldout": stats.spread([r["evals"][0]["heldout_accuracy"] for r in mine]),
            "wall_s": stats.spread([r["wall_s"] for r in mine]),
            "curves": {
                str(r["seed"]): [(e["step"], e["heldout_accuracy"]) for e in r["evals"]] for r in mine
            },
        }
    return summary


def plot(results: dict[str, Any], path: Path) -> None:
    fig, axes = figures.pyplot().subplots(1, 2, figsize=(11, 4))
    colors = {
        "async": "tab:blue",
        "sync": "tab:green",
        "async-grpo": "tab:cyan",
        "sync-grpo": "tab:olive",
        "trl": "tab:red",
        "trl-grpo": "tab:orange",
        "trl-grpo-defaults": "tab:brown",
        "trl-same-order": "tab:purple",
        "async-recompute": "tab:gray",
        "async-tis": "tab:pink",
        "async-inflight1": "black",
    }
    for name, color in colors.items():
        mine = [r for r in results["runs"] if r["name"] == name]
        if not mine:
            continue
        label = f"{name} ({len(mine)} seed{'s' if len(mine) > 1 else ''})"
        # the recipe's settings (dr_grpo) solid, the group-std variants dashed
        linestyle = "--" if "grpo" in name else "-"
        by_step: dict[int, list[float]] = {}  # held-out accuracy at each evaluated step, over seeds
        for run in mine:  # every run, faint
            steps = [e["step"] for e in run["evals"]]
            times = [e["t"] / 60 for e in run["evals"]]
            acc = [e["heldout_accuracy"] for e in run["evals"]]
            axes[0].plot(times, acc, marker="o", color=color, linestyle=linestyle, alpha=0.3)
            axes[1].plot(steps, acc, marker=".", color=color, linestyle=linestyle, alpha=0.2)
            for step, a in zip(steps, acc):
                by_step.setdefault(step, []).append(a)
        axes[0].plot([], [], marker="o", color=color, linestyle=linestyle, label=label)
        # the median over seeds at each evaluated step, bold
        steps = sorted(by_step)
        medians = [statistics.median(by_step[k]) for k in steps]
        axes[1].plot(
            steps,
            medians,
            marker="o",
            color=color,
            linestyle=linestyle,
            linewidth=2.5,
            label=f"{label}, median",
        )
    axes[0].set_xlabel("wall time from process start (min)")
    axes[1].set_xlabel("optimizer step")
    for ax in axes:
        ax.set_ylabel("held-out accuracy (greedy)")
        ax.grid(alpha=0.3)
        ax.legend()
    task = results.get("recipe", "word_problems").replace("_", " ")
    fig.suptitle(f"SmolLM2-135M-Instruct LoRA GRPO on 2 CPU cores ({task}): ours vs TRL GRPOTrainer")
    figures.save_figure(fig, path)


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Every configuration for every seed (interleaved), each in its own process, after the runs kept
    from ``config["out"]`` with ``append``; the results record."""
    out = common.results_path(config["out"])
    runs = json.loads(out.read_text())["runs"] if config["append"] and out.exists() else []
    rerun = {(name, seed) for name in config["configs"] for seed in config["seeds"]}
    runs = [r for r in runs if (r["name"], r["seed"]) not in rerun]  # a re-run replaces the old run
    for seed in config["seeds"]:  # interleaved: a slow phase of the machine hits every side alike
        for name in config["configs"]:
            cfg = {"name": name, "seed": seed, "steps": config["steps"], "recipe": config["recipe"]}
            result = common.run_child(Path(__file__), cfg, timeout_s=3600)
            print(json.dumps({k: result[k] for k in ("name", "seed", "wall_s", "evals")}), flush=True)
            runs.append(result)
            if not config["quick"]:  # each run is kept as it finishes: a stopped study resumes with --append
                common.write_results(results_record(config, runs), config["out"], indent=1, config=config)
    return results_record(config, runs)


def results_record(config: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "machine": stats.machine(),
        "steps": config["steps"],
        "recipe": config["recipe"],
        "runs": runs,
        "summary": summarize(runs, list(CONFIGS)),
    }


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=18, help="optimizer steps per run (the recipe: 18)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: seed 0, 2 steps")
    parser.add_argument(
        "--recipe",
        default="word_problems",
        choices=list(RECIPES),
        help="word_problems: examples/grpo_smollm2_cpu.yaml; reasoning_gym: examples/grpo_smollm2_reasoning_gym.yaml",
    )
    parser.add_argument(
        "--out", help="results file (a bare name: in the results folder; default: the recipe's, see RECIPES)"
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the runs already in --out (other seeds or sides; the same side and seed is re-run)",
    )
    config = common.parse_config(parser, child=child)
    config["out"] = config["out"] or RECIPES[config["recipe"]][1]
    if config["quick"]:
        config.update(seeds=[0], steps=2)
    results = run(config)
    if not config["quick"]:  # a smoke run writes nothing
        out = common.write_results(results, config["out"], indent=1, config=config)
        plot(results, out.with_suffix(".png"))
    print(json.dumps(results["summary"]))


if __name__ == "__main__":
    main()
