"""One short run of the tiny GRPO recipe per loss option: does it run, and does the reward still rise?

Each configuration is ``unirl-lightning fit --config examples/grpo_tiny.yaml`` (async, staleness 1,
120 steps) with the option's keys set from the command line, in a fresh process; the figures are
read back from its TensorBoard files: the mean sampled reward of the first and last 20 steps and the
held-out greedy accuracy at the start and the end. One run each: it shows that an option trains, not
that it helps (that needs seeds and a harder task).

The multi-turn options (``max_turn_staleness``, ``max_context_tokens``) run the same way on
``examples/agentic_guessing_tiny.yaml`` (async, staleness 1, ``tail_policy: carry``, a sync every
step, 300 steps), with the turn-staleness, eviction and context figures read back too.
``truncated_turn`` is not among them: it acts only on chat-template episodes, and the tiny recipes'
one-token compact turns are complete by design (its behaviour is pinned by tests).

    python -m benchmarks.performance.loss_options [--only NAME ...] [--steps 120] [--agentic-steps N]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.harness import common
from benchmarks.harness.common import REPO, child_env
from unirl_lightning.cli.curves import read_scalars

OPTIONS: dict[str, dict[str, str]] = {
    "baseline (PPO-clip, dual-clip 3)": {},
    "ratio_level: sequence (GSPO)": {
        "ratio_level": "sequence",
        "clip_ratio_c": "null",
        "clip_low": "0.0003",
        "clip_high": "0.0004",
        "loss_aggregation": "seq-mean-token-mean",
    },
    "loss: cispo": {"loss": "cispo", "clip_ratio_c": "null"},
    "entropy_coef: 0.01": {"entropy_coef": "0.01"},
    "sequence_mask_cap: 3": {"old_logprob": "recompute", "sequence_mask_cap": "3"},
    "filter_groups: true": {"filter_groups": "true"},
    # the recipe's budget is 2 tokens (a digit and EOS): nearly every early completion is cut, so these two
    # get room for the answer and its EOS (and the baseline is run at that budget too)
    "mask_truncated: true (2 new tokens)": {"mask_truncated": "true"},
    "overlong_buffer: 1 (2 new tokens)": {"overlong_buffer": "1", "overlong_penalty": "0.5"},
    "baseline, 4 new tokens": {"max_new_tokens": "4"},
    "mask_truncated: true (4 new tokens)": {"mask_truncated": "true", "max_new_tokens": "4"},
    "overlong_buffer: 2 (4 new tokens)": {
        "overlong_buffer": "2",
        "overlong_penalty": "0.5",
        "max_new_tokens": "4",
    },
}
# the multi-turn options, on examples/agentic_guessing_tiny.yaml (async, staleness 1, carry, a sync every
# step, 300 steps): the recipe's own step count unless --steps is given
AGENTIC_CONFIG = "examples/agentic_guessing_tiny.yaml"
AGENTIC_OPTIONS: dict[str, dict[str, str]] = {
    "agentic baseline (guessing game, carry)": {},
    "max_turn_staleness: 1": {"max_turn_staleness": "1"},
    "max_turn_staleness: 0": {"max_turn_staleness": "0"},
    "max_context_tokens: 6": {"max_context_tokens": "6"},
}
AGENTIC_FIGURES = (
    "agentic/turn_staleness_max",
    "agentic/turn_evicted_groups",
    "agentic/context_limited",
    "agentic/turns_mean",
)


def run_option(
    name: str, keys: dict[str, str], steps: int | None, config: str = "examples/grpo_tiny.yaml"
) -> dict:
    """One fit of ``config`` with the module keys ``keys`` set, in a fresh process; its figures."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "unirl_lightning.cli", "fit", "--config", config]
        command += [f"--trainer.max_steps={steps}"] if steps else []
        command += ["--trainer.enable_progress_bar=false"]
        command += [f"--trainer.logger.init_args.save_dir={tmp}", f"--trainer.default_root_dir={tmp}"]
        command += [f"--model.init_args.{key}={value}" for key, value in keys.items()]
        start = time.perf_counter()
        done = subprocess.run(
            command, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=1800
        )
        wall = time.perf_counter() - start
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines()
            return {"name": name, "ok": False, "error": lines[-1] if lines else f"exit {done.returncode}"}
        scalars = read_scalars(tmp)
    rewards = [value for _, value in scalars["rollout/reward_mean"]]
    accuracy = [value for _, value in scalars.get("eval/accuracy", [])]
    figures = {  # the last value of each multi-turn figure (the counters are cumulative), and the max
        key: {"last": scalars[key][-1][1], "max": max(v for _, v in scalars[key])}
        for key in AGENTIC_FIGURES
        if key in scalars
    }
    return {
        "name": name,
        "ok": True,
        "config": config,
        "steps": len(rewards),
        "keys": keys,
        "figures": figures,
        "reward_first20": sum(rewards[:20]) / 20,
        "reward_last20": sum(rewards[-20:]) / 20,
        "eval_start": accuracy[0] if accuracy else None,
        "eval_end": accuracy[-1] if accuracy else None,
        "wall_s": wall,
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def run(config: dict[str, Any]) -> dict[str, Any]:
    """One run per option (``config["only"]``: those only, the others' last results kept from the
    results file); the results record."""
    only = config["only"]
    results = [
        run_option(name, keys, config["steps"]) for name, keys in OPTIONS.items() if not only or name in only
    ]
    results += [
        run_option(name, keys, config["agentic_steps"], AGENTIC_CONFIG)
        for name, keys in AGENTIC_OPTIONS.items()
        if not only or name in only
    ]
    out = common.results_path("loss_options")
    if only and out.exists():  # keep the other options' last results
        kept = [r for r in json.loads(out.read_text())["results"] if r["name"] not in only]
        order = [*OPTIONS, *AGENTIC_OPTIONS]
        results = sorted(
            kept + results, key=lambda r: order.index(r["name"]) if r["name"] in order else len(order)
        )
    return {"steps": config["steps"], "results": results}


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument(
        "--only", nargs="*", help="run these option names only (the others keep their last result)"
    )
    parser.add_argument("--steps", type=int, default=120, help="steps of the single-turn runs")
    parser.add_argument("--agentic-steps", type=int, default=None, help="default: the recipe's (300)")
    config = common.parse_config(parser)
    record = run(config)
    results = record["results"]
    print("| option | reward, first 20 steps | last 20 steps | held-out accuracy start → end | wall |")
    print("|---|---|---|---|---|")
    for r in results:
        if not r["ok"]:
            print(f"| {r['name']} | failed: {r['error'].splitlines()[-1] if r['error'] else '?'} | | | |")
            continue
        print(
            f"| {r['name']} | {r['reward_first20']:.2f} | {r['reward_last20']:.2f} | "
            f"{_fmt(r['eval_start'])} → {_fmt(r['eval_end'])} | {r['wall_s']:.0f} s |"
            + "".join(
                f" {k.split('/')[1]} {v['last']:g} (max {v['max']:g})"
                for k, v in r.get("figures", {}).items()
            )
        )
    out = common.write_results(record, "loss_options", indent=1, config=config)
    print(json.dumps({"written": str(out)}))


if __name__ == "__main__":
    main()
