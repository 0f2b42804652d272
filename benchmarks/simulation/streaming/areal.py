"""AReaL's own comparison, simulated: its rollout window ``max_head_offpolicyness`` (eta) swept on one
decoupled split, with eta 0 as the synchronous run. Standard library only.

What AReaL published (inclusionAI/AReaL v0.3.0, blog/AReaL_v0_3.md Fig. 7, the bars' labels in
assets/staleness_throughput.png): DeepSeek-R1-Distill-Qwen-1.5B on 16 nodes of 8 H800s, training
throughput in k tokens/s by eta. "Synchronous AReaL" is the same decoupled system at eta 0 (its docs:
``main_async_ppo.py`` with ``max_head_offpolicyness=0``, no recompute and no decoupled loss "replicates
synchronous PPO"; an SGLang allocation always splits the GPUs), and its 2.77x (41.0 h -> 14.8 h) is eta 4
over eta 0: 356.6 / 128.7 = 2.771. Its paper gives 3/4 of the GPUs to generation. Its configs cap the
run's completions at 27,648 tokens; the blog's note on the staleness ablation says 8,192
(``--areal-max-new-tokens``).

The sweep runs at the costs every other prediction uses (the roofline carried from verl's H20
calibration). Beside it, a grid varies the two costs a data sheet cannot give: an engine's fixed cost per
decode step ``a`` (the scheduler, sampling and launches of every step, which a synchronous batch's tail
pays once per token of its longest sample) and a factor on the trainer's per-token costs (its MFU).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from benchmarks.harness import common  # noqa: F401 - this checkout first on sys.path
from benchmarks.simulation.streaming.calibrate import MODELS
from benchmarks.simulation.streaming.predict import SETTINGS, base_cfg
from benchmarks.simulation.streaming.trainer import run

# AReaL's own cap on prompts in flight: ``max_concurrent_rollouts`` (its benchmark config sets 512, and
# its default is the training batch, 512 prompts); the sweep's default is the engines' slots instead
AREAL_MAX_INFLIGHT = 512
AREAL_ETA = {"0": 128.7, "1": 269.3, "2": 356.6, "4": 356.6, "8": 371.7, "16": 382.4, "inf": 396.8}
UNBOUNDED = 1 << 20  # eta "inf": no launch ceiling but max_inflight, nothing evicted
STEP_MS, TRAINER = (6.0, 10.0, 15.0), (1.0, 3.0)  # the grid beside the roofline's step cost
GRID_ETAS = ("0", "1", "2", "4", "inf")


def eta_run(
    cfg: SimpleNamespace, gen: int, eta: str, a: float, trainer: float, max_inflight: int | None = None
) -> dict[str, Any]:
    """One run at ``eta`` on ``gen`` generation GPUs (the rest train), with step cost ``a`` and the
    trainer's per-token costs times ``trainer``, at most ``max_inflight`` groups in flight (None: the
    engines' slots over the samples). Eta 0 runs as AReaL's sync PPO: no recompute."""
    bound = UNBOUNDED if eta == "inf" else int(eta)
    slots = math.ceil(gen // cfg.tp * cfg.max_rows / cfg.samples)
    over = {
        "mode": "async",
        "gen_gpus": gen,
        "train_gpus": 128 - gen,
        "max_staleness": bound,
        "evict_staleness": bound,
        "max_inflight": slots if max_inflight is None else max_inflight,
        "async_recompute": cfg.async_recompute and bound > 0,
        "a": a,
        "update_s_per_token": cfg.update_s_per_token * trainer,
        "recompute_s_per_token": cfg.recompute_s_per_token * trainer,
    }
    return run(SimpleNamespace(**{**vars(cfg), **over}))


Runs = Callable[[str, float, float], dict[str, Any]]  # (eta, a, trainer) -> eta_run's result


def grid(runs: Runs, steps: tuple[float, ...], trainers: tuple[float, ...]) -> list:
    """Eta 0, 1, 2, 4 and unbounded at each step cost ``a`` (seconds) x trainer factor (AReaL's two
    ends, its 2.77x and the curve's rise), in absolute k tokens/s and over eta 0, each with its error
    against AReaL's."""
    rows = []
    for a in steps:
        for trainer in trainers:
            got = {eta: runs(eta, a, trainer)["trained_tokens_per_s"] / 1e3 for eta in GRID_ETAS}
            row: dict[str, Any] = {"a_ms": 1e3 * a, "trainer_factor": trainer}
            for eta, value in got.items():
                row[f"eta{eta}_k_tokens_per_s"] = value
                row[f"eta{eta}_error"] = value / AREAL_ETA[eta] - 1
            for eta in GRID_ETAS[1:]:
                row[f"eta{eta}_over_eta0"] = got[eta] / got["0"]
                row[f"eta{eta}_over_eta0_error"] = got[eta] / got["0"] / (AREAL_ETA[eta] / AREAL_ETA["0"]) - 1
            rows.append(row)
    return rows


def sweep(runs: Runs, a: float, trainer: float) -> list[dict[str, Any]]:
    rows = []
    for eta, published in AREAL_ETA.items():
        r = runs(eta, a, trainer)
        lost = r["groups"]["evicted"] + r["groups"]["dropped"]
        rows.append(
            {
                "eta": eta,
                "published_k_tokens_per_s": published,
                "simulated_k_tokens_per_s": r["trained_tokens_per_s"] / 1e3,
                "occupancy": r["occupancy"],
                "lost_group_share": lost / max(1, r["groups"]["submitted"]),
                "s_per_step": r["s_per_batch"],
                "phases_s_per_step": r["phases_s_per_batch"],
            }
        )
    for row in rows:
        row["published_over_eta0"] = row["published_k_tokens_per_s"] / rows[0]["published_k_tokens_per_s"]
        row["simulated_over_eta0"] = row["simulated_k_tokens_per_s"] / rows[0]["simulated_k_tokens_per_s"]
        row["error"] = row["simulated_over_eta0"] / row["published_over_eta0"] - 1
    return rows


def areal_eta(
    args: Any, costs: dict[str, float], law: str, gen_share: float = 0.75, with_grid: bool = False
) -> dict[str, Any]:
    """AReaL's setting on its split: the eta sweep at the roofline's costs; ``with_grid``, the two costs
    the roofline cannot know varied (:data:`STEP_MS` x :data:`TRAINER`)."""
    setting = {**SETTINGS["areal"], "max_new_tokens": args.areal_max_new_tokens}
    cfg = base_cfg(args, costs, setting, 128, law)
    gen = cfg.tp * round(gen_share * 128 / cfg.tp)
    # one run per (eta, a, trainer): the grid's roofline point is the sweep's own runs
    runs: Runs = functools.cache(lambda eta, a, trainer: eta_run(cfg, gen, eta, a, trainer))
    result = {
        "max_new_tokens": cfg.max_new_tokens,
        "train_law": law,
        "model": MODELS["1.5b"]["name"],
        "gen_gpus": gen,
        "train_gpus": 128 - gen,
        "a_ms": 1e3 * cfg.a,
        "rows": sweep(runs, cfg.a, 1.0),
    }
    if with_grid:
        result["grid"] = grid(runs, (cfg.a, *(ms / 1e3 for ms in STEP_MS)), TRAINER)
        result["areal_cap"] = areal_cap(cfg, gen)
    return result


def areal_cap(cfg: SimpleNamespace, gen: int) -> list[dict[str, Any]]:
    """:func:`grid`'s rows with AReaL's own cap of :data:`AREAL_MAX_INFLIGHT` groups in flight, at the
    roofline's step cost and at 15 ms."""

    def capped(eta: str, a: float, trainer: float) -> dict[str, Any]:
        return eta_run(cfg, gen, eta, a, trainer, AREAL_MAX_INFLIGHT)

    return [{**row, "max_inflight": AREAL_MAX_INFLIGHT} for row in grid(capped, (cfg.a, 15e-3), (1.0,))]


def print_areal_eta(result: dict[str, Any]) -> None:
    print(
        f"AReaL's eta sweep, {result['gen_gpus']}:{result['train_gpus']}, training {result['train_law']},"
        f" the roofline's costs (step cost a {result['a_ms']:.2f} ms)"
    )
    print(f"{'eta':>5} {'published':>9} {'x eta0':>7} {'simulated':>9} {'x eta0':>7} {'error':>7} {'occ':>5}")
    for r in result["rows"]:
        print(
            f"{r['eta']:>5} {r['published_k_tokens_per_s']:>9.1f} {r['published_over_eta0']:>7.2f}"
            f" {r['simulated_k_tokens_per_s']:>9.1f} {r['simulated_over_eta0']:>7.2f} {r['error']:>+7.0%}"
            f" {r['occupancy']:>5.2f}"
        )
    for r in result.get("areal_cap", []):
        cells = ", ".join(
            f"{eta} {r[f'eta{eta}_k_tokens_per_s']:.0f} ({r[f'eta{eta}_error']:+.0%}, {r.get(f'eta{eta}_over_eta0', 1.0):.2f}x)"
            for eta in GRID_ETAS
        )
        print(f"  AReaL's cap of {r['max_inflight']} in flight, a {r['a_ms']:5.2f} ms: k tokens/s {cells}")
    for r in result.get("grid", []):
        ratios = ", ".join(
            f"{eta} {r[f'eta{eta}_over_eta0']:.2f}x ({r[f'eta{eta}_over_eta0_error']:+.0%})"
            for eta in GRID_ETAS[1:]
        )
        print(
            f"  a {r['a_ms']:5.2f} ms, trainer x{r['trainer_factor']:.0f}: k tokens/s eta 0 {r['eta0_k_tokens_per_s']:.0f}"
            f" ({r['eta0_error']:+.0%}), 4 {r['eta4_k_tokens_per_s']:.0f} ({r['eta4_error']:+.0%}),"
            f" inf {r['etainf_k_tokens_per_s']:.0f} ({r['etainf_error']:+.0%}); over eta 0: {ratios}"
        )
