"""Time to accuracy: learning curves against wall-clock seconds and samples, ours vs TRL (issue 15).

    python benchmarks/time_to_accuracy.py [--quick] [--seeds 0 1 2] [--budget-s 45] [--target 0.4]

Task ``add_mod10``: prompts ``a+b=`` for digits ``a, b``; reward 1 when the completion's first
character is ``(a + b) % 10``. The 100 pairs are split 80/20 with a seeded shuffle (``--split-seed``)
and written to jsonl files: the 80 train, the 20 are held out and never trained on. (The library's
own held-out split, ``make_task(..., partition=...)``, holds out 10% of a task's prompts by a hash of
the prompt, 10 of the 100 pairs: ``--split library`` uses it instead.) Both sides read the same
files. Model: a
random-init Llama (hidden 128, 2 layers, MLP 256, the library's character tokenizer), built per seed
(``TinyCausalLM(seed=seed)``) and saved, and loaded by both sides. Per step: 8 prompts x 8 samples x
3 new tokens (EOS allowed), temperature 1, lr 3e-4 constant, fp32, ``beta=0``.

Configurations (each seed of each in its own process):

* ``trl``: TRL ``GRPOTrainer`` (HF generation, ``--trl-threads`` torch threads);
* ``sync``: ours, ``max_staleness=0, max_inflight=1``;
* ``async-s1``: ours, ``max_staleness=1, max_inflight=2``;
* ``async-s2``: ours, ``max_staleness=2, max_inflight=3``.

Ours: one Ray rollout worker (HF engine, 1 torch thread) and the trainer on 1 thread.

Each run trains for ``--budget-s`` seconds of wall-clock from the start of training (process,
Ray and model start-up excluded). Every ``--snapshot-every-s`` seconds of training time the trainer's
weights are copied (the copy is not counted as training time); after training, each snapshot is
scored with the same greedy evaluation for both sides (held-out accuracy on the 20 held-out pairs,
and on the 80 train pairs). Reported per configuration over the seeds: median and range of the
curves, the time and the samples at which the held-out accuracy first reaches ``--target`` (and
0.3 / 0.5), the final accuracy and steps/s. Prints a table and a final JSON line; writes
``benchmarks/results/time_to_accuracy.json``; ``python benchmarks/plot.py`` draws
``benchmarks/results/time_to_accuracy.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "token")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

RESULTS_PATH = common.RESULTS / "time_to_accuracy.json"
CONFIGS: dict[str, dict[str, Any]] = {
    "trl": {"side": "trl"},
    "sync": {"side": "ours", "max_staleness": 0, "max_inflight": 1},
    "async-s1": {"side": "ours", "max_staleness": 1, "max_inflight": 2},
    "async-s2": {"side": "ours", "max_staleness": 2, "max_inflight": 3},
}
TARGETS = (0.2, 0.3, 0.4, 0.5)


def split_add_mod10(seed: int) -> tuple[list[dict], list[dict]]:
    """All 100 ``a+b=`` pairs, shuffled with ``seed``, split 80 train / 20 held out."""
    records = [
        {"prompt": f"{a}+{b}=", "answer": str((a + b) % 10), "task": "add_mod10"}
        for a in range(10)
        for b in range(10)
    ]
    random.Random(seed).shuffle(records)
    return records[:80], records[80:]


def split_library(seed: int) -> tuple[list[dict], list[dict]]:
    """The library's own split (``make_task(..., partition=...)``: a hash of the prompt holds out 10% of
    the prompt space, 10 of the 100 pairs), as distinct records in a seeded order."""
    from unirl_lightning.data.tasks import make_task

    def distinct(split: str) -> list[dict]:
        seen: dict[str, dict] = {}
        for record in make_task("add_mod10", 2000, seed, partition=split):
            seen.setdefault(record["prompt"], record)
        return list(seen.values())

    return distinct("train"), distinct("held_out")


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


# -- one run (child process) -----------------------------------------------------------------------
class Snapshots:
    """The training clock (snapshot copies excluded) and the weight snapshots taken on it."""

    def __init__(self, every_s: float, budget_s: float, samples_per_step: int) -> None:
        self.every_s = every_s
        self.budget_s = budget_s
        self.samples_per_step = samples_per_step
        self.start: float | None = None
        self.paused = 0.0
        self.steps = 0
        self.window: list[float] = []
        self.points: list[dict[str, Any]] = []
        self.next_at = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start - self.paused

    def begin(self, model: Any) -> None:
        self.start = time.perf_counter()
        self.take(model, force=True)

    def take(self, model: Any, force: bool = False) -> None:
        now = self.elapsed()
        if not force and now < self.next_at:
            return
        paused = time.perf_counter()
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        window = self.window
        self.points.append(
            {
                "t": now,
                "step": self.steps,
                "samples": self.steps * self.samples_per_step,
                "train_reward": sum(window) / len(window) if window else None,  # mean since the last snapshot
                "state": state,
            }
        )
        self.window = []
        self.next_at = (int(now / self.every_s) + 1) * self.every_s
        self.paused += time.perf_counter() - paused

    def step_end(self, model: Any, reward: float | None) -> bool:
        """Count a step; snapshot when due; True once the budget is spent (a last snapshot taken)."""
        self.steps += 1
        if reward is not None:
            self.window.append(reward)
        if self.elapsed() >= self.budget_s:
            self.take(model, force=True)
            return True
        self.take(model)
        return False


def evaluate_snapshots(
    snapshots: Snapshots, model_dir: str, held_out: list[dict], train: list[dict], max_new_tokens: int
) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    curve = []
    for point in snapshots.points:
        model.load_state_dict(point.pop("state"))
        point["heldout_accuracy"] = common.greedy_accuracy(model, tokenizer, held_out, max_new_tokens)
        point["train_accuracy"] = common.greedy_accuracy(model, tokenizer, train, max_new_tokens)
        curve.append({k: (round(v, 4) if isinstance(v, float) else v) for k, v in point.items()})
    return curve


def child_trl(cfg: dict[str, Any], train: list[dict], snapshots: Snapshots) -> dict[str, Any]:
    import torch
    from transformers import TrainerCallback

    torch.set_num_threads(cfg["trl_threads"])
    last_reward: list[float] = []

    def reward(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float]:
        scores = common.first_char_reward(prompts, completions, answer, **kwargs)
        last_reward.append(sum(scores) / len(scores))
        return scores

    reward.__name__ = "first_char"

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN201
            snapshots.begin(model)

        def on_step_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN201
            if snapshots.step_end(model, last_reward[-1] if last_reward else None):
                control.should_training_stop = True

    with tempfile.TemporaryDirectory(prefix="trl-") as out:
        trainer = common.make_trl_trainer(
            cfg["model_dir"],
            train,
            prompts_per_step=cfg["prompts"],
            group=cfg["group"],
            max_new_tokens=cfg["max_new_tokens"],
            lr=cfg["lr"],
            seed=cfg["seed"],
            max_steps=10**7,
            suppress_eos=False,
            output_dir=out,
            callbacks=[Clock()],
            reward=reward,
        )
        trainer.train()
    common.check_trl_counted(trainer)
    tokens = trainer.completion_tokens
    return {
        "torch_threads": torch.get_num_threads(),
        "trl": common.trl_version(),
        "completion_tokens_per_step": sum(tokens) / max(1, len(tokens)),
    }


def child_ours(cfg: dict[str, Any], snapshots: Snapshots) -> dict[str, Any]:
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything

    from unirl_lightning import AsyncRolloutStrategy, GRPOModule, PromptDataModule
    from unirl_lightning.engines.hf import HFEngineConfig
    from unirl_lightning.models import PretrainedCausalLM

    tokens: list[float] = []

    class Clock(Callback):
        def on_train_start(self, trainer, pl_module):  # noqa: ANN001, ANN201
            snapshots.begin(pl_module.policy)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001, ANN201
            tokens.append(batch.stats["rollout/completion_tokens"])
            if snapshots.step_end(pl_module.policy, float(batch.stats["rollout/reward_mean"])):
                trainer.should_stop = True

    seed_everything(cfg["seed"])
    strategy = AsyncRolloutStrategy(
        engine=HFEngineConfig(device="cpu", num_threads=1),
        max_staleness=cfg["max_staleness"],
        max_inflight=cfg["max_inflight"],
        num_workers=1,
        trainer_threads=1,
        seed=cfg["seed"],
    )
    module = GRPOModule(
        policy=PretrainedCausalLM(name_or_path=cfg["model_dir"], dtype="float32"),
        reward=common.FirstCharReward(),
        num_generations=cfg["group"],
        max_new_tokens=cfg["max_new_tokens"],
        lr=cfg["lr"],
    )
    trainer = Trainer(
        strategy=strategy,
        max_steps=10**7,
        callbacks=[Clock()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    data = PromptDataModule(
        train=cfg["train_file"], val=cfg["val_file"], batch_size=cfg["prompts"], seed=cfg["seed"]
    )
    try:
        trainer.fit(module, datamodule=data)
    finally:
        strategy.shutdown()
    return {
        "torch_threads": torch.get_num_threads(),
        "completion_tokens_per_step": sum(tokens) / max(1, len(tokens)),
    }


def child(cfg: dict[str, Any]) -> None:
    common.quiet()
    train = [json.loads(line) for line in Path(cfg["train_file"]).read_text().splitlines()]
    held_out = [json.loads(line) for line in Path(cfg["val_file"]).read_text().splitlines()]
    snapshots = Snapshots(cfg["snapshot_every_s"], cfg["budget_s"], cfg["prompts"] * cfg["group"])
    if cfg["side"] == "trl":
        extra = child_trl(cfg, train, snapshots)
    else:
        extra = child_ours(cfg, snapshots)
    train_s = snapshots.points[-1]["t"]
    steps = snapshots.steps
    curve = evaluate_snapshots(snapshots, cfg["model_dir"], held_out, train, cfg["max_new_tokens"])
    common.emit(
        {
            "name": cfg["name"],
            "seed": cfg["seed"],
            "steps": steps,
            "train_s": train_s,
            "steps_per_s": steps / train_s,
            "ms_per_step": 1e3 * train_s / steps,
            "curve": curve,
            **extra,
        }
    )


# -- the driver ----------------------------------------------------------------------------------
def first_reach(curve: list[dict], target: float, key: str) -> float | None:
    for point in curve:
        if point["heldout_accuracy"] >= target - 1e-9:
            return point[key]
    return None


def step_curve(curve: list[dict], x_key: str, y_key: str, grid: list[float]) -> list[float | None]:
    """``y`` of the last point with ``x <= g`` for every grid value ``g`` (None before the first)."""
    out, i, current = [], 0, None
    points = [p for p in curve if p.get(y_key) is not None]
    for g in grid:
        while i < len(points) and points[i][x_key] <= g + 1e-9:
            current = points[i][y_key]
            i += 1
        out.append(current)
    return out


def band(curves: list[list[dict]], x_key: str, y_key: str, grid: list[float]) -> dict[str, list]:
    """Median and range over seeds on a common grid (up to where every seed has data)."""
    columns = [step_curve(c, x_key, y_key, grid) for c in curves]
    end = min(max((p[x_key] for p in c), default=0.0) for c in curves)
    med, lo, hi, xs = [], [], [], []
    for j, g in enumerate(grid):
        if g > end + 1e-9:
            break
        values = [col[j] for col in columns if col[j] is not None]
        if not values:
            continue
        s = common.spread(values)
        xs.append(g)
        med.append(s["median"])
        lo.append(s["min"])
        hi.append(s["max"])
    return {"x": xs, "median": med, "min": lo, "max": hi}


def summarize(runs: list[dict[str, Any]], configs: list[str], args: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    time_grid = [round(0.5 * i, 2) for i in range(int(args.budget_s / 0.5) + 2)]
    for name in configs:
        mine = sorted((r for r in runs if r["name"] == name), key=lambda r: r["seed"])
        if not mine:
            continue
        curves = [r["curve"] for r in mine]
        max_samples = max(p["samples"] for c in curves for p in c)
        sample_step = max(64, (max_samples // 100) // 64 * 64)
        sample_grid = list(range(0, max_samples + sample_step, sample_step))
        entry = {
            "seeds": [r["seed"] for r in mine],
            "steps": common.spread([r["steps"] for r in mine]),
            "steps_per_s": common.spread([r["steps_per_s"] for r in mine]),
            "ms_per_step": common.spread([r["ms_per_step"] for r in mine]),
            "final_heldout_accuracy": common.spread([r["curve"][-1]["heldout_accuracy"] for r in mine]),
            "best_heldout_accuracy": common.spread([max(p["heldout_accuracy"] for p in c) for c in curves]),
            "final_train_accuracy": common.spread([r["curve"][-1]["train_accuracy"] for r in mine]),
            "completion_tokens_per_step": common.spread([r["completion_tokens_per_step"] for r in mine]),
            "time_to": {},
            "samples_to": {},
            "curves": {
                "heldout_vs_time": band(curves, "t", "heldout_accuracy", time_grid),
                "heldout_vs_samples": band(curves, "samples", "heldout_accuracy", sample_grid),
                "reward_vs_time": band(curves, "t", "train_reward", time_grid),
                "reward_vs_samples": band(curves, "samples", "train_reward", sample_grid),
            },
        }
        for target in sorted({*TARGETS, *([args.target] if args.target else [])}):
            entry["time_to"][str(target)] = common.spread([first_reach(c, target, "t") for c in curves])
            entry["time_to"][str(target)]["per_seed"] = [first_reach(c, target, "t") for c in curves]
            entry["samples_to"][str(target)] = common.spread(
                [first_reach(c, target, "samples") for c in curves]
            )
        summary[name] = entry
    return summary


def choose_target(summary: dict[str, Any], requested: float | None) -> float:
    """``requested``, or (auto) the highest of ``TARGETS`` that every configuration reaches in at
    least half of its seeds (so every median time is defined); the lowest if none is."""
    if requested:
        return requested
    reached = [
        t
        for t in TARGETS
        if all(
            2 * sum(v is not None for v in s["time_to"][str(t)]["per_seed"])
            >= len(s["time_to"][str(t)]["per_seed"])
            for s in summary.values()
        )
    ]
    return max(reached) if reached else min(TARGETS)


def print_table(summary: dict[str, Any], target: float) -> None:
    key = str(target)
    fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
    print(
        f"{'config':<9} {'ms/step':>8} {'steps':>6} {'final acc':>10} {'range':>10} "
        f"{'t->' + key + ' s':>9} {'range':>12} {'samples->' + key:>12} {'seeds reached':>13}"
    )
    for name, s in summary.items():
        t = s["time_to"][key]
        reached = sum(v is not None for v in t["per_seed"])
        print(
            f"{name:<9} {s['ms_per_step']['median']:>8.1f} {s['steps']['median']:>6.0f} "
            f"{s['final_heldout_accuracy']['median']:>10.2f} "
            f"{s['final_heldout_accuracy']['min']:>4.2f}-{s['final_heldout_accuracy']['max']:<5.2f} "
            f"{fmt(t['median']):>9} {fmt(t['min']):>5}-{fmt(t['max']):<6} "
            f"{fmt(s['samples_to'][key]['median'], '{:.0f}'):>12} {reached:>6}/{len(t['per_seed'])}"
        )


def plot(results: dict[str, Any], path: Path) -> None:
    """Held-out greedy accuracy and training reward against seconds and samples (median, range)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, config = results["summary"], results["config"]
    colors = {"trl": "#7f8c8d", "sync": "#2f80ed", "async-s1": "#27ae60", "async-s2": "#e67e22"}
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5))
    panels = [
        ("heldout_vs_time", "training wall-clock (s)", "held-out greedy accuracy"),
        ("heldout_vs_samples", "samples trained", "held-out greedy accuracy"),
        ("reward_vs_time", "training wall-clock (s)", "training reward"),
        ("reward_vs_samples", "samples trained", "training reward"),
    ]
    for ax, (key, xlabel, ylabel) in zip(axes.flat, panels):
        for name, s in summary.items():
            c = s["curves"][key]
            ax.plot(c["x"], c["median"], color=colors.get(name), label=name, drawstyle="steps-post")
            ax.fill_between(c["x"], c["min"], c["max"], color=colors.get(name), alpha=0.15, step="post")
        if key.startswith("heldout"):
            ax.axhline(config["target"], color="k", lw=0.8, ls="--")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        f"add_mod10 (80/20 split), tiny Llama h128 L2, {config['prompts']}x{config['group']}x"
        f"{config['max_new_tokens']} tok, lr {config['lr']:g}; median and range of {len(config['seeds'])} seeds; "
        f"TRL {config.get('trl', '')}",
        fontsize=9,
    )
    common.save_figure(fig, path)


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run: seed 0 only, 6 s budget")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--budget-s", type=float, default=45.0, help="training wall-clock per run")
    parser.add_argument("--snapshot-every-s", type=float, default=1.0)
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="held-out accuracy to time (default: the highest of 0.2/0.3/0.4/0.5 every configuration reaches)",
    )
    parser.add_argument("--trl-threads", type=int, default=1, help="torch threads of the TRL process")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument(
        "--split",
        choices=["seeded", "library"],
        default="seeded",
        help="seeded: the issue's 80/20 seeded shuffle of the 100 pairs; library: the library's "
        "held-out split (make_task(partition=...), 90/10 by a hash of the prompt)",
    )
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS_PATH))
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if args.quick:
        args.seeds, args.budget_s = [0], 6.0

    common.quiet()
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    if args.split == "seeded":
        train, held_out = split_add_mod10(args.split_seed)
    else:
        train, held_out = split_library(args.split_seed)
    with tempfile.TemporaryDirectory(prefix="tta-") as tmp:
        tmp = Path(tmp)
        write_jsonl(tmp / "train.jsonl", train)
        write_jsonl(tmp / "heldout.jsonl", held_out)
        for seed in args.seeds:
            model_dir = tmp / f"model-{seed}"
            model = common.build_model_dir(
                model_dir, hidden=128, layers=2, intermediate=256, max_positions=64, seed=seed
            )
            for name in args.configs:
                cfg = {
                    "name": name,
                    "seed": seed,
                    "model_dir": str(model_dir),
                    "train_file": str(tmp / "train.jsonl"),
                    "val_file": str(tmp / "heldout.jsonl"),
                    "budget_s": args.budget_s,
                    "snapshot_every_s": args.snapshot_every_s,
                    "trl_threads": args.trl_threads,
                    "prompts": args.prompts,
                    "group": args.group,
                    "max_new_tokens": args.max_new_tokens,
                    "lr": args.lr,
                    **CONFIGS[name],
                }
                result = common.run_child(Path(__file__), cfg)
                runs.append(result)
                last = result["curve"][-1]
                print(
                    f"  seed {seed} {name:<9} {result['steps']} steps in {result['train_s']:.1f} s "
                    f"({result['ms_per_step']:.1f} ms/step), held-out acc {result['curve'][0]['heldout_accuracy']:.2f}"
                    f" -> {last['heldout_accuracy']:.2f}, time to "
                    + ", ".join(f"{t}: {first_reach(result['curve'], t, 't')}" for t in TARGETS)
                    + f" s (process {result['process_s']:.0f} s)",
                    flush=True,
                )
    summary = summarize(runs, args.configs, args)
    args.target = choose_target(summary, args.target)
    print_table(summary, args.target)
    for t in TARGETS:
        print(
            f"  time to {t}: "
            + ", ".join(f"{name} {s['time_to'][str(t)]['median']}" for name, s in summary.items())
        )
    trl = next((r.get("trl") for r in runs if r.get("trl")), common.trl_version())
    config = vars(args) | {
        "out": None,
        "child": None,
        "trl": trl,
        "model": model,
        "machine": common.machine(),
    }
    config["split"] = {
        "kind": args.split,
        "train": len(train),
        "heldout": len(held_out),
        "heldout_prompts": [r["prompt"] for r in held_out],
    }
    config["wall_s"] = round(time.perf_counter() - started, 1)
    results = {"summary": summary, "config": config, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    plot(results, Path(args.out).with_suffix(".png"))
    key = str(args.target)
    final = {
        name: {
            "ms_per_step": round(s["ms_per_step"]["median"], 1),
            "final_heldout_accuracy": s["final_heldout_accuracy"]["median"],
            f"time_to_{key}_s": s["time_to"][key]["median"],
            f"samples_to_{key}": s["samples_to"][key]["median"],
            "seeds_reached": sum(v is not None for v in s["time_to"][key]["per_seed"]),
        }
        for name, s in summary.items()
    }
    print(
        json.dumps(
            {
                "trl_version": trl,
                "quick": args.quick,
                "target": args.target,
                "budget_s": args.budget_s,
                **final,
            }
        )
    )


if __name__ == "__main__":
    main()
