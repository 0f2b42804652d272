"""Host memory of each of 2 CPU training ranks with ``load_once_per_node`` off (every rank loads the
model) and on (rank 1 builds it on the meta device and receives rank 0's weights).

Each configuration is a one-step synchronous GRPO fit of SmolLM2-135M-Instruct (bundled, no download)
on 2 gloo ranks, DDP or FSDP2, with one Ray rollout worker per rank (the workers are processes of
their own: their memory is not counted), in a fresh process (Lightning re-runs it for rank 1), in
``float32`` (the dtype of the converted copy in the cache, which ``from_pretrained`` memory-maps: the
weights are file pages, shared by every process that maps the file) and ``bfloat16`` (converted at
load: an anonymous copy per rank). Every rank reads its ``/proc/self/status`` at four points: right
after the module is built (``VmRSS`` split into ``RssAnon`` and ``RssFile``, and ``VmHWM``, the peak of
the load), at fit start (after ``configure_model`` filled the weights and the strategy's setup pushed
them to the worker), at the first step's start (``VmHWM``: the peak from the process's start to the
first step) and after that step. Python, torch, transformers and Lightning take about the same on
every rank in both settings.

On CPU the training device is the host, so a DDP rank holds its replica either way, and the first
push gathers the whole model on every rank (FSDP included): the peak to the first step hardly moves.
The build is the figure that carries over to GPUs, where a rank > 0 creates its storage on its GPU
and never holds the model on the host.

Writes ``benchmarks/results/rank_load_memory.json`` and prints a markdown table.

    python -m benchmarks.performance.rank_load_memory [--parallel ddp fsdp] [--dtype float32 bfloat16] [--load-once off on]

``--model tiny`` (a 2-layer random-init Llama instead of SmolLM2) is the smoke run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.harness import common, stats

MODEL = "smollm2-135m-instruct"
TINY = dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)  # --model tiny: a smoke run


def policy_spec(model: str, dtype: str):
    from unirl_lightning.models.causal_lm import PretrainedCausalLM, TinyCausalLM

    if model == "tiny":
        return TinyCausalLM(**TINY, dtype=dtype)
    return PretrainedCausalLM(name_or_path=MODEL, dtype=dtype, chat=True)


def status_mb() -> dict[str, float]:
    """``VmRSS``, ``VmHWM`` and the resident memory's anonymous and file-backed parts of this process, in MB."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


def child(config: dict) -> dict[str, Any] | None:
    """One configuration's fit (Lightning re-runs this command for rank 1); rank 0 returns both ranks'
    figures, gathered at the end (rank 1 returns None)."""
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything

    from unirl_lightning.callbacks import WeightSyncCallback, WeightVersionLogger
    from unirl_lightning.data import PromptDataModule
    from unirl_lightning.modules import GRPOModule
    from unirl_lightning.strategy import AsyncRolloutDDPStrategy, AsyncRolloutFSDPStrategy

    figures: dict[str, Any] = {}
    ranks: list[Any] = [None] * 2

    class Memory(Callback):
        def on_fit_start(self, trainer, pl_module):
            figures["fit_start"] = status_mb()
            figures["setup_s"] = time.perf_counter() - figures.pop("built_at")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                figures["first_step"] = status_mb()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:
                figures["after_step"] = status_mb()

        def on_train_end(self, trainer, pl_module):  # every rank's figures to rank 0
            figures["rank"] = trainer.global_rank
            torch.distributed.all_gather_object(ranks, figures)

    torch.set_num_threads(1)
    seed_everything(0)
    parallel = {"ddp": AsyncRolloutDDPStrategy, "fsdp": AsyncRolloutFSDPStrategy}[config["parallel"]]
    strategy = parallel(process_group_backend="gloo", max_staleness=0, max_inflight=1, num_workers=1)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=1,
        callbacks=[WeightSyncCallback(), WeightVersionLogger(histogram_every_n_steps=0), Memory()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    module = GRPOModule(
        policy=policy_spec(config["model"], config["dtype"]),
        num_generations=2,
        max_new_tokens=8,
        load_once_per_node=config["load_once_per_node"],
    )
    figures["built"] = status_mb()
    figures["built_at"] = time.perf_counter()
    figures["build_s"] = figures["built_at"] - start
    figures["built_on_meta"] = module.built_on_meta
    data = PromptDataModule("digit_successor", batch_size=1, num_train_prompts=16, shuffle=False)
    trainer.fit(module, datamodule=data)
    return {"ranks": ranks} if trainer.global_rank == 0 else None


def row(config: dict[str, Any], rank: dict[str, Any]) -> dict[str, Any]:
    return {
        **config,
        "rank": rank["rank"],
        "built_on_meta": rank["built_on_meta"],
        "built_rss_mb": round(rank["built"]["VmRSS"]),
        "built_anon_mb": round(rank["built"]["RssAnon"]),
        "built_file_mb": round(rank["built"]["RssFile"]),
        "peak_to_built_mb": round(rank["built"]["VmHWM"]),
        "fit_start_rss_mb": round(rank["fit_start"]["VmRSS"]),
        "fit_start_anon_mb": round(rank["fit_start"]["RssAnon"]),
        "peak_to_first_step_mb": round(rank["first_step"]["VmHWM"]),
        "peak_after_step_mb": round(rank["after_step"]["VmHWM"]),
        "build_s": round(rank["build_s"], 2),
        "setup_s": round(rank["setup_s"], 2),
    }


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Every dtype x parallel mode with the setting off, then on, each in a fresh 2-rank process; the record."""
    rows = []
    for dtype in config["dtype"]:
        for parallel in config["parallel"]:
            for on in [{"off": False, "on": True}[name] for name in config["load_once"]]:
                cfg = {
                    "dtype": dtype,
                    "parallel": parallel,
                    "load_once_per_node": on,
                    "model": config["model"],
                }
                name = f"{dtype}-{parallel}-{on}"
                result = common.run_child(Path(__file__), {**cfg, "name": name}, timeout_s=1200)
                for rank in sorted(result["ranks"], key=lambda r: r["rank"]):
                    rows.append(row(cfg, rank))
                    print(rows[-1], flush=True)
    model = f"PretrainedCausalLM({MODEL!r})" if config["model"] == "smollm2" else f"TinyCausalLM({TINY})"
    return {"model": model, "machine": stats.machine(), "rows": rows}


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--parallel", nargs="+", choices=["ddp", "fsdp"], default=["ddp", "fsdp"])
    parser.add_argument(
        "--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"]
    )
    parser.add_argument("--load-once", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2", help="tiny: a smoke run")
    config = common.parse_config(parser, child=child)
    record = run(config)
    lines = [
        "| dtype | parallel | load_once_per_node | rank | on meta | after build: RSS (anon + file) MB "
        "| peak to build MB | RSS at fit start MB | peak to first step MB | build s |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in record["rows"]:
        lines.append(
            f"| {r['dtype']} | {r['parallel']} | {r['load_once_per_node']} | {r['rank']} | {r['built_on_meta']} | "
            f"{r['built_rss_mb']:,} ({r['built_anon_mb']:,} + {r['built_file_mb']:,}) | {r['peak_to_built_mb']:,} | "
            f"{r['fit_start_rss_mb']:,} | {r['peak_to_first_step_mb']:,} | {r['build_s']} |"
        )
    print("\n".join(lines))
    peaks = {
        f"{r['dtype']} {r['parallel']} on={r['load_once_per_node']} rank{r['rank']}": r[
            "peak_to_first_step_mb"
        ]
        for r in record["rows"]
    }
    common.finish(record, "rank_load_memory", {"peak_to_first_step_mb": peaks}, config=config)


if __name__ == "__main__":
    main()
