"""Learning on the real model, ours vs TRL, over seeds: ``examples/grpo_smollm2_cpu.yaml`` (issue 25).

    python benchmarks/smollm2_learning.py [--seeds 0 1] [--configs async sync trl] [--quick]

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
  ``gradient_checkpointing=True``).

Both sides score the untrained model first (step 0), so the two evaluations are checked against each
other: they must agree there. Times are wall-clock from the start of the run's process (model
loading and the four evaluations included). ``rollout/reward/*`` (ours) and TRL's per-step reward
parts are recorded, so a run that collapses into the format bonus (boxed wrong answers: the format
part near 1, the correctness part near 0) is visible. Each run is its own process; results go to
``benchmarks/results/smollm2_learning.json`` and the plot (held-out accuracy against wall time and
against steps, median and range over seeds) to ``benchmarks/results/smollm2_learning.png``.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

START = time.perf_counter()
os.environ.setdefault("RAY_AUTH_MODE", "token")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

RESULTS_PATH = common.RESULTS / "smollm2_learning.json"
RECIPE = common.REPO / "examples" / "grpo_smollm2_cpu.yaml"
GRPO_ADVANTAGE = ["--model.init_args.advantage", "grpo"]
SYNC = ["--trainer.strategy.init_args.max_staleness", "0", "--trainer.strategy.init_args.max_inflight", "1"]
CONFIGS: dict[str, list[str]] = {  # extra CLI arguments, given to the recipe on both sides
    "async": [],
    "sync": SYNC,
    "async-grpo": GRPO_ADVANTAGE,
    "sync-grpo": [*SYNC, *GRPO_ADVANTAGE],
    "trl": [],
    "trl-grpo": GRPO_ADVANTAGE,
    "trl-grpo-defaults": GRPO_ADVANTAGE,  # and GRPOConfig's defaults bf16=True, gradient checkpointing
    "trl-same-order": [],  # TRL on our prompt stream: the same prompts at the same steps as ours
}
TRL_SIDES = ("trl", "trl-grpo", "trl-grpo-defaults", "trl-same-order")
TRL_SCALE_REWARDS = {"grpo": "group", "dr_grpo": "none"}  # our advantage -> TRL's scale_rewards


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
    from unirl_lightning.cli import main

    wall0 = time.time() - (time.perf_counter() - START)  # the process's start on the event clock
    with tempfile.TemporaryDirectory(prefix="smollm2-") as out:
        args = ["fit", "--config", str(RECIPE), "--seed_everything", str(cfg["seed"])]
        args += ["--trainer.logger.init_args.save_dir", out, "--trainer.max_steps", str(cfg["steps"])]
        args += ["--trainer.enable_progress_bar", "false", *CONFIGS[cfg["name"]]]
        main(args)
        (log_dir,) = Path(out).glob("grpo_smollm2_cpu/version_*")
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


# -- TRL ---------------------------------------------------------------------------------------------
def child_trl(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from unirl_lightning.cli import UniRLCLI
    from unirl_lightning.prompts import render_prompt_text
    from unirl_lightning.rewards.scoring import score_parts

    with tempfile.TemporaryDirectory(prefix="smollm2-trl-") as out:
        os.chdir(out)  # the parsed recipe's logger and checkpoint folders land here, unused
        args = ["--config", str(RECIPE), "--seed_everything", str(cfg["seed"]), *CONFIGS[cfg["name"]]]
        cli = UniRLCLI(args=args, run=False)
        module, data = cli.model, cli.datamodule
        (evaluator,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "RolloutEvalCallback"]
        tokenizer, sampling = module.tokenizer, module.sampling
        train = [dict(r) for r in data.train_records()]
        if cfg["name"] == "trl-same-order":  # our stream's first pass, in order (unshuffled below)
            loader = data.train_dataloader()
            loader.sampler.set_epoch(0)
            train = [dict(r) for batch in loader for r in batch]
        held_out = [dict(r) for r in data.val_records()][: evaluator.num_prompts]
        rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in train]
        parts_log: list[dict[str, float]] = []

        def reward(completions: list, answer: list, **_: Any) -> list[float]:
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            records = [{"answer": a} for a in answer]
            total, parts = score_parts(module.reward, texts, records)
            parts_log.append({k: sum(x or 0.0 for x in v) / len(v) for k, v in parts.items()})
            return total

        reward.__name__ = "recipe_reward"
        evals: list[dict[str, Any]] = []
        stop_ids = list(module.policy_spec.stop_ids(tokenizer))

        def evaluate(model: Any, step: int) -> None:
            texts = [render_prompt_text(tokenizer, r, chat=True) for r in held_out]
            was_training = model.training
            model.eval()
            side, tokenizer.padding_side = tokenizer.padding_side, "left"
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            tokenizer.padding_side = side
            with torch.no_grad():
                ids = model.generate(
                    **batch,
                    max_new_tokens=sampling.max_new_tokens,
                    do_sample=False,
                    eos_token_id=stop_ids,
                    pad_token_id=tokenizer.pad_token_id,
                )
            completions = tokenizer.batch_decode(
                ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
            )
            scores = module.reward(completions, held_out)
            accuracy = sum(s >= evaluator.accuracy_threshold for s in scores) / len(scores)
            common_answers = collections.Counter(c.strip()[:60] for c in completions).most_common(3)
            evals.append(
                {
                    "step": step,
                    "t": round(time.perf_counter() - START, 1),
                    "heldout_accuracy": accuracy,
                    "most_common_completions": common_answers,  # what a format-only collapse looks like
                }
            )
            model.train(was_training)

        class Eval(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN201
                evaluate(model, 0)

            def on_step_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN201
                if state.global_step % evaluator.every_n_steps == 0 or state.global_step == args.max_steps:
                    evaluate(model, state.global_step)

        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=data.batch_size * module.num_generations,
            gradient_accumulation_steps=1,
            num_generations=module.num_generations,
            max_completion_length=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            learning_rate=module.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=module.weight_decay,
            adam_beta1=module.betas[0],
            adam_beta2=module.betas[1],
            max_grad_norm=module.max_grad_norm,
            beta=module.kl_coef,
            epsilon=module.clip_low,
            loss_type="dapo",
            disable_dropout=True,
            # GRPOConfig's defaults are True for both; the recipe trains in float32 and does not checkpoint
            bf16=cfg["name"] == "trl-grpo-defaults",
            gradient_checkpointing=cfg["name"] == "trl-grpo-defaults",
            scale_rewards=TRL_SCALE_REWARDS[module.advantage],
            use_cpu=True,
            report_to="none",
            logging_steps=1_000_000,
            save_strategy="no",
            disable_tqdm=True,
            max_steps=cfg["steps"],
            seed=cfg["seed"],
            data_seed=cfg["seed"],
            shuffle_dataset=cfg["name"] != "trl-same-order",
            dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(
            model=module.policy,  # the recipe's SmolLM2 with its peft LoRA adapters
            reward_funcs=reward,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[Eval()],
        )
        trainer.train()
    names = sorted({k for p in parts_log for k in p})
    per_step = {f"rollout/reward/{n}_mean": [round(p.get(n, 0.0), 4) for p in parts_log] for n in names}
    return {
        "evals": evals,
        "train_rewards": per_step,
        "torch_threads": torch.get_num_threads(),
        "trl": common.trl_version(),
    }


def child(cfg: dict[str, Any]) -> None:
    common.quiet()
    result = child_trl(cfg) if cfg["name"] in TRL_SIDES else child_ours(cfg)
    common.emit(
        {"name": cfg["name"], "seed": cfg["seed"], "wall_s": round(time.perf_counter() - START, 1), **result}
    )


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
            "final_heldout": common.spread(final),
            "start_heldout": common.spread([r["evals"][0]["heldout_accuracy"] for r in mine]),
            "wall_s": common.spread([r["wall_s"] for r in mine]),
            "curves": {
                str(r["seed"]): [(e["step"], e["heldout_accuracy"]) for e in r["evals"]] for r in mine
            },
        }
    return summary


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colors = {
        "async": "tab:blue",
        "sync": "tab:green",
        "async-grpo": "tab:cyan",
        "sync-grpo": "tab:olive",
        "trl": "tab:red",
        "trl-grpo": "tab:orange",
        "trl-grpo-defaults": "tab:brown",
        "trl-same-order": "tab:purple",
    }
    for name, color in colors.items():
        mine = [r for r in results["runs"] if r["name"] == name]
        for i, run in enumerate(mine):
            label = f"{name} ({len(mine)} seed{'s' if len(mine) > 1 else ''})" if i == 0 else None
            steps = [e["step"] for e in run["evals"]]
            times = [e["t"] / 60 for e in run["evals"]]
            acc = [64 * e["heldout_accuracy"] for e in run["evals"]]
            # the recipe's settings (dr_grpo) solid, the group-std variants dashed and faded
            style = (
                {"linestyle": "--", "alpha": 0.45} if "grpo" in name else {"linestyle": "-", "alpha": 0.85}
            )
            axes[0].plot(times, acc, marker="o", color=color, label=label, **style)
            axes[1].plot(steps, acc, marker="o", color=color, label=label, **style)
    axes[0].set_xlabel("wall time from process start (min)")
    axes[1].set_xlabel("optimizer step")
    for ax in axes:
        ax.set_ylabel("held-out problems solved (greedy, of 64)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("SmolLM2-135M-Instruct LoRA GRPO on 2 CPU cores: ours (async, sync) vs TRL GRPOTrainer")
    common.save_figure(fig, path)


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=18, help="optimizer steps per run (the recipe: 18)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: seed 0, 2 steps")
    parser.add_argument("--out", default=str(RESULTS_PATH))
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the runs already in --out (other seeds or sides; the same side and seed is re-run)",
    )
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if args.quick:
        args.seeds, args.steps = [0], 2
    runs = json.loads(Path(args.out).read_text())["runs"] if args.append and Path(args.out).exists() else []
    rerun = {(name, seed) for name in args.configs for seed in args.seeds}
    runs = [r for r in runs if (r["name"], r["seed"]) not in rerun]  # a re-run replaces the old run
    for seed in args.seeds:  # interleaved: a slow phase of the machine hits every side alike
        for name in args.configs:
            run = common.run_child(
                Path(__file__), {"name": name, "seed": seed, "steps": args.steps}, timeout_s=3600
            )
            print(json.dumps({k: run[k] for k in ("name", "seed", "wall_s", "evals")}), flush=True)
            runs.append(run)
    results = {
        "machine": common.machine(),
        "steps": args.steps,
        "runs": runs,
        "summary": summarize(runs, list(CONFIGS)),
    }
    if not args.quick:
        Path(args.out).write_text(json.dumps(results, indent=1))
        plot(results, Path(args.out).with_suffix(".png"))
    print(json.dumps(results["summary"]))


if __name__ == "__main__":
    main()
