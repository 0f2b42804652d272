"""Time to accuracy: learning curves against wall-clock seconds and samples, ours vs TRL (issue 15).

    python -m benchmarks.peers.time_to_accuracy [--quick] [--seeds 0 1 2] [--budget-s 45] [--target 0.4]

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
``benchmarks/results/time_to_accuracy.json``; ``python -m benchmarks.harness.plot`` draws
``benchmarks/results/time_to_accuracy.png``. One run (a child process) is in
``time_to_accuracy_sides.py``, the analysis and the figure in ``time_to_accuracy_report.py``.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import common, sides, stats
from benchmarks.peers import time_to_accuracy_report as report
from benchmarks.peers import trl_side
from benchmarks.peers.time_to_accuracy_report import TARGETS
from benchmarks.peers.time_to_accuracy_sides import child

CONFIGS: dict[str, dict[str, Any]] = {
    "trl": {"side": "trl"},
    "sync": {"side": "ours", "max_staleness": 0, "max_inflight": 1},
    "async-s1": {"side": "ours", "max_staleness": 1, "max_inflight": 2},
    "async-s2": {"side": "ours", "max_staleness": 2, "max_inflight": 3},
}


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


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Every configuration for every seed, each in its own process; the summary (at the chosen
    target), the config and the runs."""
    common.quiet()
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    if config["split"] == "seeded":
        train, held_out = split_add_mod10(config["split_seed"])
    else:
        train, held_out = split_library(config["split_seed"])
    with tempfile.TemporaryDirectory(prefix="tta-") as tmp:
        tmp = Path(tmp)
        write_jsonl(tmp / "train.jsonl", train)
        write_jsonl(tmp / "heldout.jsonl", held_out)
        for seed in config["seeds"]:
            model_dir = tmp / f"model-{seed}"
            model = sides.build_model_dir(
                model_dir, hidden=128, layers=2, intermediate=256, max_positions=64, seed=seed
            )
            for name in config["configs"]:
                cfg = {
                    "name": name,
                    "seed": seed,
                    "model_dir": str(model_dir),
                    "train_file": str(tmp / "train.jsonl"),
                    "val_file": str(tmp / "heldout.jsonl"),
                    **{k: config[k] for k in ("budget_s", "snapshot_every_s", "trl_threads", "prompts")},
                    **{k: config[k] for k in ("group", "max_new_tokens", "lr")},
                    **CONFIGS[name],
                }
                result = common.run_child(Path(__file__), cfg)
                runs.append(result)
                curve = result["curve"]
                print(
                    f"  seed {seed} {name:<9} {result['steps']} steps in {result['train_s']:.1f} s "
                    f"({result['ms_per_step']:.1f} ms/step), held-out acc {curve[0]['heldout_accuracy']:.2f}"
                    f" -> {curve[-1]['heldout_accuracy']:.2f}, time to "
                    + ", ".join(f"{t}: {report.first_reach(curve, t, 't')}" for t in TARGETS)
                    + f" s (process {result['process_s']:.0f} s)",
                    flush=True,
                )
    summary = report.summarize(runs, config["configs"], config)
    target = report.choose_target(summary, config["target"])
    trl = next((r.get("trl") for r in runs if r.get("trl")), trl_side.trl_version())
    recorded = config | {"target": target, "out": None, "child": None, "trl": trl, "model": model}
    recorded["machine"] = stats.machine()
    recorded["split"] = {
        "kind": config["split"],
        "train": len(train),
        "heldout": len(held_out),
        "heldout_prompts": [r["prompt"] for r in held_out],
    }
    recorded["wall_s"] = round(time.perf_counter() - started, 1)
    return {"summary": summary, "config": recorded, "runs": runs}


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
    parser.add_argument(
        "--out", default="time_to_accuracy", help="results file (a bare name: in the results folder)"
    )
    config = common.parse_config(parser, child=child)
    if config["quick"]:
        config.update(seeds=[0], budget_s=6.0)
    results = run(config)
    summary, target = results["summary"], results["config"]["target"]
    report.print_table(summary, target)
    for t in TARGETS:
        print(
            f"  time to {t}: "
            + ", ".join(f"{n} {s['time_to'][str(t)]['median']}" for n, s in summary.items())
        )
    out = common.write_results(results, config["out"], config=config)
    report.plot(results, out.with_suffix(".png"))
    head = {"trl_version": results["config"]["trl"], "quick": config["quick"], "target": target}
    print(json.dumps({**head, "budget_s": config["budget_s"], **report.final_line(summary, target)}))


if __name__ == "__main__":
    main()
