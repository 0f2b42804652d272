"""Async quiesce vs async interrupt vs sync on a long-tail length workload (tiny model, CPU).

    python -m benchmarks.performance.interrupt_long_tail [--rounds 3] [--steps 12] [--max-new-tokens 64]

The workload: the tiny random-init Llama's character vocabulary has 21 tokens and EOS is one of
them, so an untrained policy stops with probability ~1/21 per token: completion lengths are
geometric (median ~13 tokens) and ~4% of the samples run into ``max_new_tokens=64``. With 128 rows
per request, every request has a few; an HF ``generate`` call lasts as long as its longest row.

Modes (one rollout worker, one torch thread each side): ``sync`` (``max_staleness=0,
max_inflight=1``), ``async_quiesce`` (``max_staleness=1, max_inflight=2``, the sync waits for the
request in flight) and ``async_interrupt`` (the same with ``sync_mode="interrupt"``,
``interrupt_chunk_tokens`` per chunk). The modes are interleaved round by round (mode order
rotated), so a load change on the shared machine hits all of them. Per run: trained completion
tokens per second after the warm-up, ``sync/quiesce_s``, the fraction of trained tokens at each
staleness, and the held-out accuracy (``eval/accuracy`` on 16 prompts) at the last step. Prints a
table of medians and writes benchmarks/results/interrupt_long_tail.json (every run, and the phase
costs the simulator calibrates against).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from benchmarks.harness import common
from unirl_lightning import AsyncRolloutStrategy, GRPOModule, PromptDataModule, TinyCausalLM
from unirl_lightning.callbacks import RolloutEvalCallback, WeightSyncCallback
from unirl_lightning.engines.hf import HFEngineConfig
from unirl_lightning.rewards import ExactMatchReward

STREAM = dict(batching="continuous", launch_unit="group", sync_mode="continue")
MODES = {
    "sync": dict(max_staleness=0, max_inflight=1),
    "async_quiesce": dict(max_staleness=1, max_inflight=2),
    "async_interrupt": dict(max_staleness=1, max_inflight=2, sync_mode="interrupt"),
    # the same, on the continuously batching HF engine (rows of the next request fill freed slots)
    "sync_continuous": dict(max_staleness=0, max_inflight=1, batching="continuous"),
    "async_continuous": dict(max_staleness=1, max_inflight=2, batching="continuous"),
    # ... and every prompt its own launch, reaped as it finishes (launch_unit="group")
    "async_groups": dict(max_staleness=1, max_inflight=2, batching="continuous", launch_unit="group"),
    "async_groups_s2": dict(max_staleness=2, max_inflight=3, batching="continuous", launch_unit="group"),
    # ... and the weights pushed without draining (rows in flight go on in place)
    "async_groups_continue": dict(max_staleness=1, max_inflight=2, **STREAM),
    "async_groups_continue_s2": dict(max_staleness=2, max_inflight=3, **STREAM),
    # ... with each step's prompts trained as 2 steps of half the prompts, one push after both (the same
    # groups per weight version; verl's require_batches: the first half trains while the rest finish)
    "async_groups_continue_split2": dict(max_staleness=1, max_inflight=4, split=2, **STREAM),
    "async_groups_continue_split4": dict(max_staleness=1, max_inflight=8, split=4, **STREAM),
}
MEDIANS = ("tokens_per_s", "steps_per_s", "quiesce_s", "push_s", "generate_s", "train_s", "wait_s")
MEDIANS += ("engine_occupancy", "engine_busy", "engine_step_ms", "engine_starved", "window_headroom")
MEDIANS += ("eval_accuracy",)


class Meter(Callback):
    """Trained tokens, step metrics and sync figures of every step after the warm-up."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: float | None = None
        self.end = 0.0
        self.tokens = 0
        self.lengths: list[int] = []
        self.steps: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.warmup:
            self.start = time.perf_counter()
        if batch_idx >= self.warmup:
            lengths = batch.response_mask.sum(dim=1).tolist()
            self.tokens += int(sum(lengths))
            self.lengths += [int(n) for n in lengths]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.end = time.perf_counter()
        if batch_idx >= self.warmup:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            metrics.update(pl_module.last_logged_metrics)
            metrics.update(trainer.strategy.last_sync)
            self.steps.append(metrics)


def tiny_policy(config: dict[str, Any]) -> TinyCausalLM:
    shape = dict(hidden_size=config["hidden"], num_layers=config["layers"], num_heads=4)
    return TinyCausalLM(**shape, intermediate_size=2 * config["hidden"], max_position_embeddings=128)


def run_mode(mode: str, config: dict[str, Any]) -> dict[str, Any]:
    seed_everything(0)
    options = dict(MODES[mode])
    split = options.pop("split", 1)  # steps per weight version, each of batch / split prompts
    meter, batch = Meter(config["warmup"] * split), config["batch"] // split
    engine = HFEngineConfig(
        batching=options.pop("batching", "static"),
        max_batch_size=config["slots"],
        # group launches: every group in flight (up to max_inflight steps' worth) is a call of its own
        concurrent_calls=batch * options.get("max_inflight", 1),
    )
    strategy = AsyncRolloutStrategy(**options, engine=engine, interrupt_chunk_tokens=config["chunk"])
    module = GRPOModule(
        policy=tiny_policy(config),
        reward=ExactMatchReward(),
        num_generations=config["group"],
        max_new_tokens=config["max_new_tokens"],
        lr=config["lr"],
    )
    steps = (config["steps"] + config["warmup"]) * split
    evaluator = RolloutEvalCallback(every_n_steps=steps, num_prompts=16)
    trainer = Trainer(
        strategy=strategy,
        max_steps=steps,
        callbacks=[WeightSyncCallback(every_n_steps=split), meter, evaluator],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = PromptDataModule(train="digit_successor", batch_size=batch, num_val_prompts=16)
    trainer.fit(module, datamodule=data)
    interrupted = getattr(strategy.runtime.controller, "interrupted_jobs", 0)
    strategy.shutdown()
    m = meter.steps

    def mean(key: str) -> float:  # over the steps that logged it (0.0: none did, e.g. a static engine)
        seen = [s[key] for s in m if key in s]
        return sum(seen) / len(seen) if seen else 0.0

    staleness = {
        str(k): sum(s.get(f"rollout/token_staleness/{k}", 0.0) for s in m) / len(m) for k in range(2)
    }
    return {
        "mode": mode,
        "steps": len(m),
        "tokens_per_s": meter.tokens / (meter.end - meter.start),
        "steps_per_s": len(m) / split / (meter.end - meter.start),  # steps of --batch prompts
        "quiesce_s": mean("sync/quiesce_s"),
        "push_s": mean("sync/time_s"),
        "generate_s": mean("perf/generate_time_s"),
        "train_s": mean("perf/train_time_s"),
        "wait_s": mean("perf/wait_time_s"),
        "engine_occupancy": mean("rollout/engine_occupancy"),
        "engine_busy": mean("rollout/engine_busy"),  # the continuous engine's loop: share of time stepping
        "engine_step_ms": mean("rollout/engine_step_ms"),  # ... and its mean step
        "engine_starved": mean("rollout/engine_starved"),  # free slots with nothing queued
        "window_headroom": mean("rollout/window_headroom"),  # groups the window still admits
        "token_staleness": staleness,
        "interrupted_samples_per_step": mean("rollout/interrupted_samples"),
        "interrupted_jobs": interrupted,
        # the last step's evaluation runs after the meter's snapshot of that step: read its own record
        "eval_accuracy": evaluator.history[-1]["eval/accuracy"] if evaluator.history else float("nan"),
        "completion_len_mean": sum(meter.lengths) / len(meter.lengths),
        "completion_len_p50": statistics.median(meter.lengths),
        "at_max_new_tokens": sum(n >= config["max_new_tokens"] for n in meter.lengths) / len(meter.lengths),
        "completion_lengths": meter.lengths,
    }


def generation_throughput(config: dict[str, Any], requests: int = 4) -> tuple[dict[str, float], list[int]]:
    """Generation alone, in this process, one torch thread: ``requests`` requests of the workload
    (``batch`` prompts x ``group`` samples at temperature 1), one after another on the static engine
    (as a one-call-at-a-time worker serves them) and all at once on the continuous one; completion
    tokens per wall second, interleaved over ``rounds`` (medians), and the continuous engine's
    completion lengths (what the simulator's engine-alone calibration draws from)."""
    import threading

    from unirl_lightning.rollout.records import RolloutRequest, SamplingParams

    policy = tiny_policy(config)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=config["max_new_tokens"])
    records = [{"prompt": f"{i % 10}", "answer": "0"} for i in range(config["batch"])]
    seen: dict[str, list[float]] = {"static": [], "continuous": []}
    lengths: list[int] = []
    for round_ in range(config["rounds"]):
        for batching in ("static", "continuous") if round_ % 2 == 0 else ("continuous", "static"):
            engine = HFEngineConfig(
                device="cpu",
                num_threads=1,
                batching=batching,
                max_batch_size=config["slots"],
            ).build(policy)
            batch = [
                RolloutRequest(
                    records=records, n=config["group"], sampling=sampling, seed=100 * round_ + i, gen_id=i
                )
                for i in range(requests)
            ]
            out: list[Any] = []
            start = time.perf_counter()
            if batching == "static":
                out = [engine.generate(r) for r in batch]
            else:
                threads = [
                    threading.Thread(
                        target=lambda r=r, out=out, engine=engine: out.append(engine.generate(r))
                    )
                    for r in batch
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            seconds = time.perf_counter() - start
            engine.close()
            done = [len(x.completion_ids) for groups in out for g in groups for x in g]
            seen[batching].append(sum(done) / seconds)
            lengths += done if batching == "continuous" else []
    return {k: statistics.median(v) for k, v in seen.items()}, lengths


def run(config: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    generation, generation_lengths = generation_throughput(config)
    print(f"generation tokens/s: {generation}", flush=True)
    runs: list[dict[str, Any]] = []
    modes = [mode for mode in MODES if mode in config["modes"]]
    for round_ in range(config["rounds"]):
        turn = round_ % len(modes)
        for mode in modes[turn:] + modes[:turn]:  # rotated: no mode always runs first
            result = run_mode(mode, config)
            result["round"] = round_
            runs.append(result)
            print(
                f"round {round_} {mode:<16} {result['tokens_per_s']:>8.1f} tok/s  quiesce "
                f"{result['quiesce_s']:.3f} s  stale1 {result['token_staleness']['1']:.3f}",
                flush=True,
            )
    medians: dict[str, dict[str, float]] = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        medians[mode] = {key: statistics.median(r[key] for r in mine) for key in MEDIANS}
        medians[mode]["token_staleness_1"] = statistics.median(r["token_staleness"]["1"] for r in mine)
        medians[mode]["interrupted_samples_per_step"] = statistics.median(
            r["interrupted_samples_per_step"] for r in mine
        )

    def over(mode: str, base: str) -> float | None:  # None: one of the two did not run (--modes)
        if mode not in medians or base not in medians:
            return None
        return round(medians[mode]["tokens_per_s"] / medians[base]["tokens_per_s"], 3)

    summary = {
        "generation_tokens_per_s": generation,
        "continuous_generation_over_static": round(generation["continuous"] / generation["static"], 3),
        "generation_lengths": generation_lengths,
        "async_quiesce_over_sync": over("async_quiesce", "sync"),
        "async_interrupt_over_sync": over("async_interrupt", "sync"),
        "interrupt_over_quiesce": over("async_interrupt", "async_quiesce"),
        "async_continuous_over_sync_continuous": over("async_continuous", "sync_continuous"),
        # every mode after async_quiesce: its trained tokens/s over the request-at-a-time async
        **{f"{m}_over_async_quiesce": over(m, "async_quiesce") for m in list(MODES)[3:]},
        "medians": medians,
        "config": config | {"out": None},
    }
    return {"summary": summary, "runs": runs}


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=8, help="interrupt_chunk_tokens")
    parser.add_argument("--lr", type=float, default=3e-3, help="0: the policy stays put (equal work)")
    parser.add_argument("--batch", type=int, default=16, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--slots", type=int, default=None, help="engine rows at once; default: a step's")
    parser.add_argument(
        "--out", default="interrupt_long_tail", help="results file (a bare name: in the results folder)"
    )
    config = common.parse_config(parser)
    config["slots"] = config["slots"] or config["batch"] * config["group"]
    record = run(config)
    print(
        f"{'mode':<16} {'tok/s':>8} {'occupancy':>9} {'quiesce s':>10} {'push s':>7} {'stale-1':>8} {'eval':>6}"
    )
    for mode, r in record["summary"]["medians"].items():
        print(
            f"{mode:<16} {r['tokens_per_s']:>8.1f} {r['engine_occupancy']:>9.3f} {r['quiesce_s']:>10.3f} "
            f"{r['push_s']:>7.3f} {r['token_staleness_1']:>8.3f} {r['eval_accuracy']:>6.3f}"
        )
    common.finish(
        record,
        config["out"],
        {k: v for k, v in record["summary"].items() if k not in ("medians", "generation_lengths")},
        config=config,
    )


if __name__ == "__main__":
    main()
