"""Ours vs TRL's ``GRPOTrainer`` on the same machine, same weights, same workload (issue 11).

    python -m benchmarks.peers.vs_trl [--quick] [--runs 3] [--workloads base long] [--configs ...]

Workloads (GRPO, ``digit_successor`` with an 8-digit distractor prefix, 16 prompts x 8 samples per
step, lr 1e-6 so nothing changes length, fp32, temperature 1):

* ``base``: 16 new tokens per completion (the issue's workload);
* ``long``: 64 new tokens per completion (generation-heavier);
* ``wide``: another model shape and prompt length: a random-init Llama of hidden 256, 2 layers, MLP
  512, and a 24-digit distractor prefix (prompts about three times as long), 32 new tokens;
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
  optimizer step, ``torch.set_num_threads(1 or 2)``; generation and training take turns. Activation
  checkpointing is off (``gradient_checkpointing=False``: TRL's default ``True`` recomputes every
  backward's activations, which ours does not); ``trl-defaults`` is ``trl-2t`` with TRL's default on.
* ``sync``: ours, ``max_staleness=0, max_inflight=1``: one Ray rollout worker with 1 torch
  thread, the trainer with 1 (``trainer_threads=1``), taking turns.
* ``sync-2t``: the same with 2 threads on each side (they never run at once).
* ``async``: ours, ``max_staleness=1, max_inflight=2``: worker 1 thread + trainer 1 thread,
  generation of the next batch overlapping training of this one.
* ``hybrid`` / ``hybrid-2t``: ours, ``placement="hybrid"``: the HF engine in the training process (no
  Ray, the trainer's tensors shared with the engine), synchronous, 1 or 2 threads.

Throughput is measured after ``--warmup`` steps, from the end of the last warm-up step to the end of
the last step (start-up excluded); each configuration runs ``--runs`` times (interleaved, so slow
phases of a shared machine hit every configuration alike) and the median is reported, with the
range. Prints a table and a final JSON line; writes ``benchmarks/results/vs_trl.json``;
``python -m benchmarks.harness.plot`` draws ``benchmarks/results/vs_trl.png``. The analysis and the figure
are in ``vs_trl_report.py``, TRL's trainer in ``trl_side.py``.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import common, processes, sides, stats
from benchmarks.peers import trl_side
from benchmarks.peers import vs_trl_report as report

WORKLOADS = {"base": 16, "long": 64, "wide": 32, "smollm2": 16}  # new tokens per completion
DEFAULT_WORKLOADS = ["base", "wide"]
TINY_SHAPE = {"hidden": 128, "layers": 4, "intermediate": 256}
MODEL_SHAPE = {"wide": {"hidden": 256, "layers": 2, "intermediate": 512}}  # others: TINY_SHAPE
PREFIX_LEN = {"wide": 24}  # digits of distractor before the question; others 8
WORKLOAD_SHAPE = {"smollm2": {"prompts": 4, "group": 4}}  # overrides of --prompts / --group
OURS_SYNC = {"side": "ours", "max_staleness": 0, "max_inflight": 1}
CONFIGS: dict[str, dict[str, Any]] = {
    "trl-1t": {"side": "trl", "threads": 1},
    "trl-2t": {"side": "trl", "threads": 2},
    "trl-defaults": {"side": "trl", "threads": 2, "gradient_checkpointing": True},
    "sync": {**OURS_SYNC, "trainer_threads": 1, "worker_threads": 1},
    "sync-2t": {**OURS_SYNC, "trainer_threads": 2, "worker_threads": 2},
    "hybrid": {**OURS_SYNC, "placement": "hybrid", "trainer_threads": 1, "worker_threads": 1},
    "hybrid-2t": {**OURS_SYNC, "placement": "hybrid", "trainer_threads": 2, "worker_threads": 2},
    "async": {
        "side": "ours",
        "max_staleness": 1,
        "max_inflight": 2,
        "trainer_threads": 1,
        "worker_threads": 1,
    },
}
DEFAULT_CONFIGS = ["trl-1t", "trl-2t", "sync", "sync-2t", "async", "hybrid", "hybrid-2t"]


# -- one configuration (child process) -------------------------------------------------------------
def child_ours(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything

    from unirl_lightning import AsyncRolloutStrategy, GRPOModule, PromptDataModule
    from unirl_lightning.engines.hf import HFEngineConfig
    from unirl_lightning.models.causal_lm import PretrainedCausalLM

    class Clock(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.metrics: list[dict[str, float]] = []
            self.cpu: list[dict[str, Any]] = []  # every process's CPU time, at the timed window's ends

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001, ANN201
            if len(self.stamps) + 1 == cfg["warmup"]:  # the window's start: sampled before its stamp
                self.cpu.append(processes.snapshot()["rows"])
            self.stamps.append(time.perf_counter())
            if len(self.stamps) == cfg["warmup"] + cfg["steps"]:  # its end: after its stamp
                self.cpu.append(processes.snapshot()["rows"])
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
        placement=cfg.get("placement", "separate"),
        trainer_threads=cfg["trainer_threads"],
        seed=cfg["seed"],
    )
    module = GRPOModule(
        policy=PretrainedCausalLM(name_or_path=cfg["model_dir"], dtype="float32"),
        reward=sides.FirstCharReward(),
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
        train="digit_successor",
        batch_size=cfg["prompts"],
        task_kwargs={"prefix_len": cfg["prefix_len"]},
        seed=cfg["seed"],
    )
    try:
        trainer.fit(module, datamodule=data)
    finally:
        strategy.shutdown()
    steps, seconds = trl_side.timing(clock.stamps, cfg["warmup"])
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
        "cpu_share": processes.cpu_share(*clock.cpu, seconds) if len(clock.cpu) == 2 else None,
        "torch_threads": torch.get_num_threads(),
    }


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    result = trl_side.timed_run(cfg) if cfg["side"] == "trl" else child_ours(cfg)
    return {"name": cfg["name"], "workload": cfg["workload"], **result}


# -- the benchmark -----------------------------------------------------------------------------------
def run(config: dict[str, Any]) -> dict[str, Any]:
    """Every configuration of every workload, ``config["runs"]`` times (interleaved), each in its own
    process; the summary, the config and the runs."""
    common.quiet()
    started = time.perf_counter()
    suppress = config["stopping"] == "suppressed"
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vs-trl-model-") as model_dir:
        tiny = sides.build_model_dir(model_dir, **TINY_SHAPE, seed=config["seed"], suppress_eos=suppress)
        models: dict[str, Any] = {"tiny": tiny}
        model_dirs = {workload: model_dir for workload in config["workloads"]}
        for workload in config["workloads"]:
            if workload in MODEL_SHAPE:
                model_dirs[workload] = str(Path(model_dir) / workload)
                models[workload] = sides.build_model_dir(
                    model_dirs[workload], **MODEL_SHAPE[workload], seed=config["seed"], suppress_eos=suppress
                )
            elif workload == "smollm2":
                model_dirs[workload] = str(Path(model_dir) / workload)
                models[workload] = sides.build_smollm2_dir(model_dirs[workload], suppress)
        model = tiny if len(models) == 1 else models
        for run_index in range(config["runs"]):
            for workload in config["workloads"]:
                for name in config["configs"]:
                    cfg = {
                        "name": name,
                        "workload": workload,
                        "run": run_index,
                        "model_dir": model_dirs[workload],
                        "max_new_tokens": WORKLOADS[workload],
                        "prefix_len": PREFIX_LEN.get(workload, 8),
                        "steps": config["steps"] if workload == "base" else config["steps_long"],
                        "warmup": config["warmup"],
                        "prompts": config["prompts"],
                        "group": config["group"],
                        **WORKLOAD_SHAPE.get(workload, {}),
                        "lr": config["lr"],
                        "seed": config["seed"],
                        "suppress_eos": suppress,
                        **CONFIGS[name],
                    }
                    result = common.run_child(Path(__file__), cfg)
                    result["run"] = run_index
                    runs.append(result)
                    print(
                        f"  run {run_index} {workload:<5} {name:<8} {result['steps_per_s']:.3f} steps/s "
                        f"({result['completions_per_s']:.0f} completions/s, tokens/step {result['tokens_per_step']}, "
                        f"process {result['process_s']:.0f} s)",
                        flush=True,
                    )
    summary = report.summarize(runs, config["workloads"], config["configs"])
    trl = next((r.get("trl") for r in runs if r.get("trl")), trl_side.trl_version())
    recorded = config | {"out": None, "child": None, "trl": trl, "model": model, "machine": stats.machine()}
    recorded["wall_s"] = round(time.perf_counter() - started, 1)
    return {"summary": summary, "config": recorded, "runs": runs}


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 run, 2+3 steps per config")
    parser.add_argument("--runs", type=int, default=3, help="runs per configuration (median reported)")
    parser.add_argument("--steps", type=int, default=16, help="timed steps, base workload")
    parser.add_argument(
        "--steps-long", type=int, default=6, help="timed steps, long, wide and smollm2 workloads"
    )
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
    parser.add_argument("--out", default=None, help="results file (default: vs_trl, natural: vs_trl_natural)")
    config = common.parse_config(parser, child=child)
    if config["out"] is None:
        config["out"] = "vs_trl" if config["stopping"] == "suppressed" else "vs_trl_natural"
    if config["quick"]:
        config.update(runs=1, steps=3, steps_long=2, warmup=2)
    results = run(config)
    report.print_table(results["summary"])
    out = common.write_results(results, config["out"], config=config)
    report.plot(results, out.with_suffix(".png"))
    head = {"trl_version": results["config"]["trl"], "quick": config["quick"], "stopping": config["stopping"]}
    print(json.dumps({**head, **report.final_line(results["summary"])}))


if __name__ == "__main__":
    main()
