"""Ours vs TRL's ``GRPOTrainer`` on the same machine, same weights, same workload (issue 11).

    python benchmarks/vs_trl.py [--quick] [--runs 3] [--workloads base long] [--configs ...]

Workloads (GRPO, ``digit_successor`` with an 8-digit distractor prefix, 16 prompts x 8 samples per
step, lr 1e-6 so nothing changes length, fp32, temperature 1):

* ``base``: 16 new tokens per completion (the issue's workload);
* ``long``: 64 new tokens per completion (generation-heavier);
* ``smollm2``: the real SmolLM2-135M-Instruct (float32, its own tokenizer, every end token
  suppressed), 4 prompts x 4 samples x 16 new tokens per step (``--workloads smollm2``; each step
  takes seconds, not tenths).

The model is a random-init Llama (hidden 128, 4 layers, MLP 256, the library's character
tokenizer), built once with seed 0 and saved to a temporary folder; both sides load that folder
(ours: ``PretrainedCausalLM(name_or_path=dir, dtype="float32")``, TRL: ``from_pretrained``). EOS is
suppressed on both sides (``suppress_tokens`` in the saved generation config, and in TRL's
``generation_kwargs``), so every completion is exactly ``max_new_tokens`` long; the tokens each
side generated per step are counted and reported (they must be equal). With ``--stopping natural``
nothing is suppressed: EOS ends completions as in real runs, lengths differ between the sides, and
the figure to compare is completion tokens per second (``tokens_per_s``, the tokens of the timed
steps over their wall time; results in ``vs_trl_natural.json``). Reward on both sides: the first
character of the completion equals the answer.

Configurations, each in its own process (torch threads and Ray start fresh):

* ``trl-1t`` / ``trl-2t``: TRL ``GRPOTrainer`` with HF generation, ``beta=0``, one generation per
  optimizer step, ``torch.set_num_threads(1 or 2)``; generation and training take turns.
* ``sync``: ours, ``max_staleness=0, max_inflight=1``: one Ray rollout worker with 1 torch
  thread, the trainer with 1 (``trainer_threads=1``), taking turns.
* ``sync-2t``: the same with 2 threads on each side (they never run at once).
* ``async``: ours, ``max_staleness=1, max_inflight=2``: worker 1 thread + trainer 1 thread,
  generation of the next batch overlapping training of this one.

Throughput is measured after ``--warmup`` steps, from the end of the last warm-up step to the end of
the last step (start-up excluded); each configuration runs ``--runs`` times (interleaved, so slow
phases of a shared machine hit every configuration alike) and the median is reported, with the
range. Prints a table and a final JSON line; writes ``benchmarks/results/vs_trl.json``;
``python benchmarks/plot.py`` draws ``benchmarks/results/vs_trl.png``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "token")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

RESULTS_PATH = common.RESULTS / "vs_trl.json"
WORKLOADS = {"base": 16, "long": 64, "smollm2": 16}  # new tokens per completion
DEFAULT_WORKLOADS = ["base", "long"]
WORKLOAD_SHAPE = {"smollm2": {"prompts": 4, "group": 4}}  # overrides of --prompts / --group
CONFIGS: dict[str, dict[str, Any]] = {
    "trl-1t": {"side": "trl", "threads": 1},
    "trl-2t": {"side": "trl", "threads": 2},
    "sync": {
        "side": "ours",
        "max_staleness": 0,
        "max_inflight": 1,
        "trainer_threads": 1,
        "worker_threads": 1,
    },
    "sync-2t": {
        "side": "ours",
        "max_staleness": 0,
        "max_inflight": 1,
        "trainer_threads": 2,
        "worker_threads": 2,
    },
    "async": {
        "side": "ours",
        "max_staleness": 1,
        "max_inflight": 2,
        "trainer_threads": 1,
        "worker_threads": 1,
    },
}
DEFAULT_CONFIGS = ["trl-1t", "trl-2t", "sync", "sync-2t", "async"]


# -- one run (child process) -----------------------------------------------------------------------
def _timing(stamps: list[float], warmup: int) -> tuple[int, float]:
    """Steps and seconds from the end of the last warm-up step to the end of the last step."""
    steps = len(stamps) - warmup
    return steps, stamps[-1] - stamps[warmup - 1]


def child_trl(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import TrainerCallback

    from unirl_lightning.data.tasks import make_task

    torch.set_num_threads(cfg["threads"])

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            self.stamps.append(time.perf_counter())

    clock = Clock()
    records = make_task("digit_successor", 1024, cfg["seed"], prefix_len=8)
    with tempfile.TemporaryDirectory(prefix="trl-") as out:
        trainer = common.make_trl_trainer(
            cfg["model_dir"],
            records,
            prompts_per_step=cfg["prompts"],
            group=cfg["group"],
            max_new_tokens=cfg["max_new_tokens"],
            lr=cfg["lr"],
            seed=cfg["seed"],
            max_steps=cfg["warmup"] + cfg["steps"],
            suppress_eos=cfg["suppress_eos"],
            output_dir=out,
            callbacks=[clock],
        )
        trainer.train()
    common.check_trl_counted(trainer)
    steps, seconds = _timing(clock.stamps, cfg["warmup"])
    w = cfg["warmup"]
    tokens = trainer.completion_tokens[w:]
    return {
        "steps": steps,
        "seconds": seconds,
        "steps_per_s": steps / seconds,
        "completions_per_s": steps * cfg["prompts"] * cfg["group"] / seconds,
        "tokens_per_s": sum(tokens) / seconds,
        "tokens_per_step": sorted(set(tokens)),
        "prompt_tokens_per_step": sorted(set(trainer.prompt_tokens[w:])),
        "generate_s": sum(trainer.generate_s[w:]) / steps,
        "prepare_s": sum(trainer.prepare_s[w:]) / steps,  # generate + score + advantages (+ old log-probs)
        "train_s": seconds / steps - sum(trainer.prepare_s[w:]) / steps,  # the rest of the step
        "torch_threads": torch.get_num_threads(),
        "trl": common.trl_version(),
    }


def child_ours(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything

    from unirl_lightning import AsyncRolloutStrategy, GRPOModule, PromptDataModule
    from unirl_lightning.engines.hf import HFEngineConfig
    from unirl_lightning.models import PretrainedCausalLM

    class Clock(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.metrics: list[dict[str, float]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001, ANN201
            self.stamps.append(time.perf_counter())
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            metrics.update(pl_module.last_logged_metrics)  # the figures written straight to the loggers
            metrics["rows"] = float(batch.num_rows)
            metrics["prompt_tokens"] = float((batch.attention_mask.sum() - batch.response_mask.sum()).item())
            self.metrics.append(metrics)

    seed_everything(cfg["seed"])
    strategy = AsyncRolloutStrategy(
        engine=HFEngineConfig(device="cpu", num_threads=cfg["worker_threads"]),
        max_staleness=cfg["max_staleness"],
        max_inflight=cfg["max_inflight"],
        num_workers=1,
        trainer_threads=cfg["trainer_threads"],
        seed=cfg["seed"],
    )
    module = GRPOModule(
        policy=PretrainedCausalLM(name_or_path=cfg["model_dir"], dtype="float32"),
        reward=common.FirstCharReward(),
        num_generations=cfg["group"],
        max_new_tokens=cfg["max_new_tokens"],
        lr=cfg["lr"],
    )
    clock = Clock()
    trainer = Trainer(
        strategy=strategy,
        max_steps=cfg["warmup"] + cfg["steps"],
        callbacks=[clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    data = PromptDataModule(
        train="digit_successor", batch_size=cfg["prompts"], task_kwargs={"prefix_len": 8}, seed=cfg["seed"]
    )
    try:
        trainer.fit(module, datamodule=data)
    finally:
        strategy.shutdown()
    steps, seconds = _timing(clock.stamps, cfg["warmup"])
    timed = clock.metrics[cfg["warmup"] :]

    def mean(key: str) -> float:
        return sum(m.get(key, 0.0) for m in timed) / len(timed)

    return {
        "steps": steps,
        "seconds": seconds,
        "steps_per_s": steps / seconds,
        "completions_per_s": steps * cfg["prompts"] * cfg["group"] / seconds,
        "tokens_per_s": sum(m["rollout/completion_tokens"] for m in timed) / seconds,
        "tokens_per_step": sorted({int(m["rollout/completion_tokens"]) for m in timed}),
        "prompt_tokens_per_step": sorted({int(m["prompt_tokens"]) for m in timed}),
        "generate_s": mean("perf/generate_time_s"),
        "train_s": mean("perf/train_time_s"),
        "sync_s": mean("sync/time_s"),
        "wait_s": mean("perf/wait_time_s"),
        "overlap": mean("perf/overlap"),
        "sync_share": mean("sync/time_s") * steps / seconds,
        "max_staleness_seen": max(m.get("rollout/staleness_max", 0.0) for m in timed),
        "torch_threads": torch.get_num_threads(),
    }


def child(cfg: dict[str, Any]) -> None:
    common.quiet()
    result = child_trl(cfg) if cfg["side"] == "trl" else child_ours(cfg)
    common.emit({"name": cfg["name"], "workload": cfg["workload"], **result})


# -- the driver ----------------------------------------------------------------------------------
def summarize(runs: list[dict[str, Any]], workloads: list[str], configs: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for workload in workloads:
        rows: dict[str, Any] = {}
        for name in configs:
            mine = [r for r in runs if r["workload"] == workload and r["name"] == name]
            if not mine:
                continue
            tokens = sorted({t for r in mine for t in r["tokens_per_step"]})
            rows[name] = {
                "steps_per_s": common.spread([r["steps_per_s"] for r in mine]),
                "completions_per_s": common.spread([r["completions_per_s"] for r in mine]),
                "tokens_per_s": common.spread([r["tokens_per_s"] for r in mine]),
                "generate_s": common.spread([r["generate_s"] for r in mine])["median"],
                "train_s": common.spread([r.get("train_s") for r in mine])["median"],
                "sync_s": common.spread([r.get("sync_s") for r in mine])["median"],
                "sync_share": common.spread([r.get("sync_share") for r in mine])["median"],
                "tokens_per_step": tokens,
                "prompt_tokens_per_step": sorted(
                    {t for r in mine for t in r.get("prompt_tokens_per_step", [])}
                ),
                "runs": len(mine),
            }
        best_trl = max(
            (rows[n]["completions_per_s"]["median"] for n in rows if n.startswith("trl")), default=None
        )

        def ratio(
            name: str, base: float | None, key: str = "completions_per_s", rows: dict[str, Any] = rows
        ) -> float | None:
            if name not in rows or not base:
                return None
            return round(rows[name][key]["median"] / base, 3)

        best_trl_tokens = max(
            (rows[n]["tokens_per_s"]["median"] for n in rows if n.startswith("trl")), default=None
        )

        sync_base = rows["sync"]["completions_per_s"]["median"] if "sync" in rows else None
        all_tokens = sorted({t for row in rows.values() for t in row["tokens_per_step"]})
        all_prompt = sorted({t for row in rows.values() for t in row["prompt_tokens_per_step"]})
        summary[workload] = {
            "configs": rows,
            "best_trl_completions_per_s": best_trl,
            "sync_vs_best_trl": ratio("sync", best_trl),
            "sync_2t_vs_best_trl": ratio("sync-2t", best_trl),
            "async_vs_best_trl": ratio("async", best_trl),
            "async_vs_sync": ratio("async", sync_base),
            # per completion token (what counts when EOS ends completions at different lengths)
            "best_trl_tokens_per_s": best_trl_tokens,
            "sync_tokens_vs_best_trl": ratio("sync", best_trl_tokens, "tokens_per_s"),
            "sync_2t_tokens_vs_best_trl": ratio("sync-2t", best_trl_tokens, "tokens_per_s"),
            "async_tokens_vs_best_trl": ratio("async", best_trl_tokens, "tokens_per_s"),
            "tokens_per_step": all_tokens,
            "tokens_equal": len(all_tokens) == 1,
            "prompt_tokens_per_step": all_prompt,
        }
    return summary


def lengths(tokens: list[int]) -> str:
    """The distinct tokens-per-step counts (a range when natural stopping makes them many)."""
    return ",".join(map(str, tokens)) if len(tokens) <= 3 else f"{min(tokens)}-{max(tokens)}"


def print_table(summary: dict[str, Any]) -> None:
    header = (
        f"{'workload':<8} {'config':<8} {'steps/s':>8} {'range':>13} {'compl/s':>8} {'vs TRL':>7} "
        f"{'tok/s':>7} {'vs TRL':>7} {'gen s':>6} {'train s':>7} {'sync s':>7} {'tokens/step':>11}"
    )
    print(header)
    for workload, s in summary.items():
        best, best_tokens = s["best_trl_completions_per_s"], s["best_trl_tokens_per_s"]
        for name, row in s["configs"].items():
            sps = row["steps_per_s"]
            cps = row["completions_per_s"]["median"]
            vs = f"{cps / best:.2f}x" if best else "-"
            tps = row["tokens_per_s"]["median"]
            vs_tokens = f"{tps / best_tokens:.2f}x" if best_tokens else "-"
            fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
            print(
                f"{workload:<8} {name:<8} {sps['median']:>8.3f} {sps['min']:>6.2f}-{sps['max']:<6.2f} "
                f"{cps:>8.1f} {vs:>7} {tps:>7.0f} {vs_tokens:>7} {fmt(row['generate_s']):>6} {fmt(row['train_s']):>7} "
                f"{fmt(row['sync_s']):>7} {lengths(row['tokens_per_step']):>11}"
            )


def plot(results: dict[str, Any], path: Path) -> None:
    """Completions/s (natural stopping: completion tokens/s) per configuration and workload (median,
    bars = range over runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    fig, axes = plt.subplots(1, len(summary), figsize=(5 * len(summary), 3.4), squeeze=False)
    colors = {
        "trl-1t": "#c9ccd1",
        "trl-2t": "#9aa5b1",
        "sync": "#8fb8f0",
        "sync-2t": "#2f80ed",
        "async": "#27ae60",
    }
    key = (
        "completions_per_s"
        if results["config"].get("stopping", "suppressed") == "suppressed"
        else "tokens_per_s"
    )
    for ax, (workload, s) in zip(axes[0], summary.items()):
        names = list(s["configs"])
        med = [s["configs"][n][key]["median"] for n in names]
        lo = [m - s["configs"][n][key]["min"] for m, n in zip(med, names)]
        hi = [s["configs"][n][key]["max"] - m for m, n in zip(med, names)]
        bars = ax.bar(names, med, yerr=[lo, hi], capsize=3, color=[colors.get(n, "#777") for n in names])
        ax.bar_label(bars, fmt="%.0f", padding=2)
        tokens = lengths(s["tokens_per_step"])
        ax.set_title(f"{workload}: {WORKLOADS.get(workload, '?')} new tokens ({tokens} tok/step)", fontsize=9)
        ax.set_ylabel(key.replace("_per_s", " / s").replace("_", " "))
        ax.grid(axis="y", alpha=0.3)
    stopping = "EOS suppressed" if key == "completions_per_s" else "natural stopping (EOS ends completions)"
    fig.suptitle(
        f"GRPO vs TRL {results['config'].get('trl', '')} GRPOTrainer, 2 CPU cores\n{stopping}", fontsize=9
    )
    common.save_figure(fig, path)


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 run, 2+3 steps per config")
    parser.add_argument("--runs", type=int, default=3, help="runs per configuration (median reported)")
    parser.add_argument("--steps", type=int, default=16, help="timed steps, base workload")
    parser.add_argument("--steps-long", type=int, default=6, help="timed steps, long and smollm2 workloads")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of every run")
    parser.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS, choices=list(WORKLOADS))
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--stopping",
        choices=["suppressed", "natural"],
        default="suppressed",
        help="suppressed: every end token suppressed on both sides (equal lengths); natural: EOS ends "
        "completions as in real runs (compare tokens/s)",
    )
    parser.add_argument("--out", default=None, help="default: results/vs_trl.json (vs_trl_natural.json)")
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    suppress = args.stopping == "suppressed"
    if args.out is None:
        args.out = str(RESULTS_PATH if suppress else RESULTS_PATH.with_name("vs_trl_natural.json"))
    if args.quick:
        args.runs, args.steps, args.steps_long, args.warmup = 1, 3, 2, 2

    common.quiet()
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vs-trl-model-") as model_dir:
        model = common.build_model_dir(
            model_dir, hidden=128, layers=4, intermediate=256, seed=args.seed, suppress_eos=suppress
        )
        model_dirs = {workload: model_dir for workload in args.workloads}
        if "smollm2" in args.workloads:
            model_dirs["smollm2"] = str(Path(model_dir) / "smollm2")
            model = {"tiny": model, "smollm2": common.build_smollm2_dir(model_dirs["smollm2"], suppress)}
        for run in range(args.runs):
            for workload in args.workloads:
                for name in args.configs:
                    cfg = {
                        "name": name,
                        "workload": workload,
                        "run": run,
                        "model_dir": model_dirs[workload],
                        "max_new_tokens": WORKLOADS[workload],
                        "steps": args.steps if workload == "base" else args.steps_long,
                        "warmup": args.warmup,
                        "prompts": args.prompts,
                        "group": args.group,
                        **WORKLOAD_SHAPE.get(workload, {}),
                        "lr": args.lr,
                        "seed": args.seed,
                        "suppress_eos": suppress,
                        **CONFIGS[name],
                    }
                    result = common.run_child(Path(__file__), cfg)
                    result["run"] = run
                    runs.append(result)
                    print(
                        f"  run {run} {workload:<5} {name:<8} {result['steps_per_s']:.3f} steps/s "
                        f"({result['completions_per_s']:.0f} completions/s, tokens/step {result['tokens_per_step']}, "
                        f"process {result['process_s']:.0f} s)",
                        flush=True,
                    )
    summary = summarize(runs, args.workloads, args.configs)
    print_table(summary)
    trl = next((r.get("trl") for r in runs if r.get("trl")), common.trl_version())
    config = vars(args) | {
        "out": None,
        "child": None,
        "trl": trl,
        "model": model,
        "machine": common.machine(),
    }
    config["wall_s"] = round(time.perf_counter() - started, 1)
    results = {"summary": summary, "config": config, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    plot(results, Path(args.out).with_suffix(".png"))
    final = {
        workload: {
            "completions_per_s": {n: c["completions_per_s"]["median"] for n, c in s["configs"].items()},
            "sync_vs_best_trl": s["sync_vs_best_trl"],
            "async_vs_best_trl": s["async_vs_best_trl"],
            "async_vs_sync": s["async_vs_sync"],
            "sync_tokens_vs_best_trl": s["sync_tokens_vs_best_trl"],
            "async_tokens_vs_best_trl": s["async_tokens_vs_best_trl"],
        }
        for workload, s in summary.items()
    }
    print(json.dumps({"trl_version": trl, "quick": args.quick, "stopping": args.stopping, **final}))


if __name__ == "__main__":
    main()
