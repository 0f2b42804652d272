"""Where a tiny GRPO step's time goes beyond generate and train (issue 15 #2, issue 11 #3).

    python benchmarks/step_overhead.py [--quick] [--steps 50] [--warmup 5] [--runs NAME ...]

Runs, each in its own process, on the *tiny* workload of issue 15 (``add_mod10``, 8 prompts x 8
samples x 3 new tokens, random-init Llama hidden 128, 2 layers, MLP 256, lr 3e-4; one Ray rollout
worker with 1 torch thread, trainer 1 thread):

* ``sync-full``: ``max_staleness=0, max_inflight=1`` set up the way ``examples/grpo_tiny.yaml`` runs:
  TensorBoard logger with ``log_every_n_steps=1``, the default callbacks, the progress bar,
  ``RolloutEvalCallback(every_n_steps=20, num_prompts=20)``;
* ``sync-bare``: the same without logger, progress bar and eval (how ``vs_trl.py`` and
  ``time_to_accuracy.py`` run ours);
* ``async-full``: ``sync-full`` with ``max_staleness=1, max_inflight=2``;
* ``vs_trl-sync``: ``sync-bare`` on issue 11's workload (``digit_successor`` with an 8-digit prefix,
  16 x 8 x 16 tokens, hidden 128, 4 layers, EOS suppressed);
* ``sync-cprofile``: ``sync-full`` under ``cProfile`` (the top functions by own time);
* ``train-profile``: the train step under ``torch.profiler`` on issue 11's workload (the timers'
  labels and the top ops);
* ``push-variants``: the weight push alone (``ObjectStoreWeightSync.push``), the ``ensure_alive``
  ping that precedes it and a bare Ray actor call (the floor of any push), round-robin.

Timers (``step_overhead_timers.py``): public per-step functions of the library, Lightning and torch
are wrapped in the child process (no library change) with an exclusive-time stack, so every
millisecond of a step is attributed to exactly one component; what no wrapper covers is Lightning's
loop itself ("lightning loop (rest)", its logger connector included). The worker's own generate and
score time comes from the batch's ``perf/`` figures; the driver's time launching, polling and waiting
beyond that is the Ray round trip. Step time is measured from the end of one step
(``on_train_batch_end``) to the end of the next, over ``--steps`` steps after ``--warmup``. "Fixed
overhead" = step time - generation on the step's path (sync: the worker's generate and score; async:
the waits for generation, including the quiesce before each push) - train compute (forward, loss,
backward, clip, optimizer step, zero_grad, advantages). Target (issue 15): <= 15 ms. Both the means
(which add up to the step) and the medians over steps (robust to the stalls of a shared machine)
are reported.

Prints a breakdown table (ms per step per component) and a final JSON line; writes
``benchmarks/results/step_overhead.json``; ``python benchmarks/plot.py`` draws
``benchmarks/results/step_overhead.png`` (``step_overhead_report.py``).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import step_overhead_report as report
from step_overhead_timers import Timers, cprofile_table, instrument, make_probe, torch_table

TARGET_MS = 15.0
TINY = {"layers": 2, "task": "add_mod10", "task_kwargs": {}, "prompts": 8, "group": 8}
VS_TRL = {"layers": 4, "task": "digit_successor", "task_kwargs": {"prefix_len": 8}, "prompts": 16, "group": 8}
WORKLOADS = {
    "tiny": {**TINY, "max_new_tokens": 3, "lr": 3e-4, "suppress_eos": False, "max_positions": 64},
    "vs_trl": {**VS_TRL, "max_new_tokens": 16, "lr": 1e-6, "suppress_eos": True, "max_positions": 128},
}
RUNS: dict[str, dict[str, Any]] = {
    "sync-full": {"workload": "tiny", "mode": "sync", "full": True, "profile": "timers"},
    "sync-bare": {"workload": "tiny", "mode": "sync", "full": False, "profile": "timers"},
    "async-full": {"workload": "tiny", "mode": "async", "full": True, "profile": "timers"},
    "sync-cprofile": {"workload": "tiny", "mode": "sync", "full": True, "profile": "cprofile"},
    "vs_trl-sync": {"workload": "vs_trl", "mode": "sync", "full": False, "profile": "timers"},
    "train-profile": {"workload": "vs_trl", "mode": "sync", "full": False, "profile": "torch"},
    "push-variants": {"workload": "tiny", "mode": "sync", "full": False, "profile": "push"},
}


# -- one run (child process) -----------------------------------------------------------------------
def child_push(cfg: dict[str, Any]) -> dict[str, Any]:
    """The weight push, the ping before it and a bare Ray call, timed alone (round-robin)."""
    import ray
    import torch

    from unirl_lightning.engines.hf import HFEngineConfig
    from unirl_lightning.models.causal_lm import PretrainedCausalLM
    from unirl_lightning.weight_sync import ObjectStoreWeightSync
    from unirl_lightning.weight_sync.base import named_weights
    from unirl_lightning.workers import RolloutWorkerGroup, shutdown_ray_if_owned

    torch.set_num_threads(1)
    spec = PretrainedCausalLM(name_or_path=cfg["model_dir"], dtype="float32")
    model, _ = spec.build()
    workers = RolloutWorkerGroup(HFEngineConfig(device="cpu", num_threads=1), spec, reward=None)
    worker, sync, version = workers.workers[0], ObjectStoreWeightSync(), [0]

    def library_push() -> None:
        version[0] += 1
        sync.push(model, workers, version[0])

    variants = {
        "library push (ObjectStoreWeightSync)": library_push,
        "ensure_alive ping (before every push)": lambda: workers.ensure_alive(30.0),
        "bare actor call (round trip)": lambda: ray.get(worker.weight_version.remote()),
    }
    times = common.interleaved(variants, cfg["reps"] - 1)  # the first round is the warm-up
    tensors = named_weights(model)
    state = ray.get(worker.state_dict.remote())  # the pushed weights really arrive
    same = all(torch.equal(state[k], v) for k, v in tensors.items())
    workers.shutdown()
    shutdown_ray_if_owned()
    return {
        "name": cfg["name"],
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "tensors": len(tensors),
        "weights_arrived": same,
        "ms": {name: 1e3 * statistics.median(v) for name, v in times.items()},
        "reps": cfg["reps"],
    }


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg["profile"] == "push":
        return child_push(cfg)
    import torch
    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.loggers import TensorBoardLogger

    from unirl_lightning import AsyncRolloutStrategy, GRPOModule, PromptDataModule
    from unirl_lightning.callbacks import RolloutEvalCallback
    from unirl_lightning.engines.hf import HFEngineConfig
    from unirl_lightning.models.causal_lm import PretrainedCausalLM

    wl, profile = WORKLOADS[cfg["workload"]], cfg["profile"]
    timers = Timers(record_function=profile == "torch")
    if profile in ("timers", "torch"):
        instrument(timers)
    warmup, steps = cfg["warmup"], cfg["steps"]

    seed_everything(0)
    strategy = AsyncRolloutStrategy(
        engine=HFEngineConfig(device="cpu", num_threads=1),
        max_staleness=0 if cfg["mode"] == "sync" else 1,
        max_inflight=1 if cfg["mode"] == "sync" else 2,
        num_workers=1,
        trainer_threads=1,
        seed=0,
    )
    module = GRPOModule(
        policy=PretrainedCausalLM(name_or_path=cfg["model_dir"], dtype="float32"),
        reward=common.FirstCharReward(),
        num_generations=wl["group"],
        max_new_tokens=wl["max_new_tokens"],
        lr=wl["lr"],
    )
    probe = make_probe(timers, profile, warmup, steps)
    callbacks: list[Any] = [probe]
    with tempfile.TemporaryDirectory(prefix="overhead-") as logdir:
        if cfg["full"]:
            callbacks.append(RolloutEvalCallback(every_n_steps=20, num_prompts=20))
        trainer = Trainer(
            strategy=strategy,
            max_steps=warmup + steps,
            callbacks=callbacks,
            logger=TensorBoardLogger(logdir, name="run") if cfg["full"] else False,
            log_every_n_steps=1,
            enable_checkpointing=False,
            enable_progress_bar=cfg["full"],
            enable_model_summary=False,
            limit_val_batches=0,
        )
        data = PromptDataModule(
            train=wl["task"], batch_size=wl["prompts"], task_kwargs=wl["task_kwargs"] or None, seed=0
        )
        try:
            trainer.fit(module, datamodule=data)
        finally:
            strategy.shutdown()

    stamps, per_step = probe.stamps, probe.per_step
    window_s = stamps[warmup + steps - 1] - stamps[warmup - 1]
    result: dict[str, Any] = {
        **{k: cfg[k] for k in ("name", "workload", "mode", "full", "steps")},
        "step_ms": 1e3 * window_s / steps,
        "step_ms_median": 1e3
        * statistics.median(b - a for a, b in zip(stamps[warmup - 1 :], stamps[warmup:])),
        "padding_fraction": statistics.fmean(probe.padding),
        "untrained_logit_positions": statistics.fmean(probe.untrained_positions),
        "torch_threads": torch.get_num_threads(),
    }
    if profile in ("timers", "torch"):
        frozen = probe.frozen
        result["own_ms"] = {k: 1e3 * v / steps for k, v in frozen["own"].items()}
        result["total_ms"] = {k: 1e3 * v / steps for k, v in frozen["total"].items()}
        result["calls_per_step"] = {k: v / steps for k, v in frozen["calls"].items()}
        result["worker_ms"] = {
            k: sum(p["worker_ms"][k] for p in per_step) / steps for k in ("generate", "score")
        }
        result["per_step"] = per_step
        result["missing"] = timers.missing
    if profile == "cprofile":
        result["cprofile"] = cprofile_table(probe.profiler, steps, cfg.get("prof_out"))
    if profile == "torch":
        result["torch_profile"] = torch_table(probe.profiler, steps)
    return result


# -- the benchmark -----------------------------------------------------------------------------------
def run(config: dict[str, Any]) -> dict[str, Any]:
    """Every run of ``config["runs"]``, each in its own process; the results record."""
    common.quiet()
    started = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="overhead-model-") as tmp:
        dirs = {}
        for name, wl in WORKLOADS.items():
            dirs[name] = str(Path(tmp) / name)
            common.build_model_dir(
                dirs[name],
                hidden=128,
                layers=wl["layers"],
                intermediate=256,
                max_positions=wl["max_positions"],
                seed=0,
                suppress_eos=wl["suppress_eos"],
            )
        for name in config["runs"]:
            spec = RUNS[name]
            cfg = {
                "name": name,
                **spec,
                "model_dir": dirs[spec["workload"]],
                "steps": config["steps"] if spec["profile"] != "torch" else min(config["steps"], 10),
                "warmup": config["warmup"],
                "prof_out": config["prof_out"],
                "reps": 5 if config["quick"] else 15,
            }
            result = common.run_child(Path(__file__), cfg)
            if spec["profile"] == "timers":
                report.derive(result)
            runs[name] = result
            if "step_ms" in result:
                print(
                    f"  {name:<14} {result['step_ms']:.1f} ms/step (process {result['process_s']:.0f} s)",
                    flush=True,
                )
    recorded = config | {"out": None, "child": None, "workloads": WORKLOADS, "machine": common.machine()}
    recorded["wall_s"] = round(time.perf_counter() - started, 1)
    return {"config": recorded, "runs": runs, "target_ms": TARGET_MS}


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 warm-up + 8 steps")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--prof-out", default=None, help="also dump the cProfile stats here (pstats file)")
    parser.add_argument("--out", default=str(common.results_path("step_overhead")))
    config = common.parse_config(parser, child=child)
    if config["quick"]:
        config.update(steps=8, warmup=3)
    results = run(config)
    runs = results["runs"]
    report.print_breakdown(runs)
    report.print_medians(runs)
    report.print_profiles(runs)
    out = common.write_results(results, config["out"])
    if any("breakdown" in r for r in runs.values()):
        report.plot(results, out.with_suffix(".png"))
    head = {"quick": config["quick"], "target_fixed_overhead_ms": TARGET_MS}
    print(json.dumps({**head, **report.final_line(runs)}))


if __name__ == "__main__":
    main()
