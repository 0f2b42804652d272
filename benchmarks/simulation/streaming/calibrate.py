"""The cost prior (a roofline of the engine) and the reproduction of verl's published phase table.

Calibration uses the SYNC rows only: the engine costs are the roofline's times one factor chosen so
that colocated sync on 128 GPUs generates in the published 177.85 s (``--verl-fit fixed``: the
fixed cost per decode step alone fitted, the other costs the roofline's); the recompute and update costs per
token are the published seconds over the simulated tokens per step; the training-scaling exponent is
the one that joins the published update times of colocated sync at 64 and 128 GPUs; the push is the
rest of the sync step. The async 64:64 row is then predicted, never fitted.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

from benchmarks.simulation.streaming.trainer import run

SOURCE = "volcengine/verl docs/advance/fully_async.md, 'Asynchronous Training on 7B Model' (H20)"
SETTING = {
    "model": "Qwen2.5-Math-7B",
    "algorithm": "DAPO, rollout.n=16, ppo_mini_batch_size=32 prompts, vLLM TP4 + FSDP2",
    "max_response_length": 28672,
    "colocate_sync": "train_batch_size=512 prompts, 400 steps",
    "fully_async": "require_batches=4, trigger_parameter_sync_step=4, staleness_threshold=0.5, partial_rollout=True",
}
PUBLISHED = {  # seconds per step of 512 prompts x 16
    "sync_128": {"step": 356.30, "gen": 177.85, "old_log_prob": 53.92, "update_actor": 113.81},
    "sync_64": {"step": 365.28, "gen": 150.72, "old_log_prob": 70.26, "update_actor": 133.41},
    "async_64_64": {"step": 150.63, "gen": 33.14, "old_log_prob": 0.0, "update_actor": 113.16},
}
HARDWARE = {  # dense bf16 FLOP/s, HBM bytes/s, memory GB (an H800 is an H100 here)
    "h20": {"flops": 148e12, "hbm_bytes_per_s": 4.0e12, "memory_gb": 96.0},
    "h100": {"flops": 989e12, "hbm_bytes_per_s": 3.35e12, "memory_gb": 80.0},
}
MODELS = {  # parameters, and KV-cache bytes per token in bf16 (layers x K+V x KV heads x head dim x 2)
    "7b": {"name": "Qwen2.5-7B", "params": 7.6e9, "kv_bytes_per_token": 28 * 2 * 4 * 128 * 2},
    "1.5b": {
        "name": "DeepSeek-R1-Distill-Qwen-1.5B",
        "params": 1.78e9,
        "kv_bytes_per_token": 28 * 2 * 2 * 128 * 2,
    },
}
QWEN_7B = MODELS["7b"]


def roofline(tp: int, scale: float = 1.0, hw: str = "h20", model: str = "7b") -> dict[str, float]:
    """Decode step ``a + b*rows + c*context`` and prefill per token of one engine of ``tp`` GPUs (bf16):
    weights read at 80% of HBM bandwidth plus 1.5 ms of launch overhead (+1 ms of all-reduce when
    tp > 1), 2 FLOPs per parameter per token at 50% (decode) / 60% (prefill) of peak, the KV cache read
    at 80% of HBM bandwidth; all times ``scale``."""
    bw, flops = tp * HARDWARE[hw]["hbm_bytes_per_s"] * 0.8, tp * HARDWARE[hw]["flops"]
    step = 2 * MODELS[model]["params"]
    return {
        "a": scale * (1.5e-3 + step / bw + (1.0e-3 if tp > 1 else 0.0)),
        "b": scale * step / (flops * 0.5),
        "c": scale * MODELS[model]["kv_bytes_per_token"] / bw,
        "prefill": scale * step / (flops * 0.6),
    }


def kv_budget(tp: int, hw: str = "h20", utilisation: float = 0.8, model: str = "7b") -> int:
    """Context tokens one engine's KV cache holds (vLLM ``gpu_memory_utilization`` 0.8, weights out)."""
    free = tp * HARDWARE[hw]["memory_gb"] * 1e9 * utilisation - 2 * MODELS[model]["params"]
    return int(free / MODELS[model]["kv_bytes_per_token"])


def verl_cfg(args: Any, **over: Any) -> SimpleNamespace:
    """The verl workload (every number not published is an assumption flag: lengths, prompt length)."""
    cfg = {
        "prompt_len": args.verl_prompt_len,
        "samples": 16,
        "median_len": args.verl_median_len,
        "sigma": args.verl_sigma,
        "max_new_tokens": 28672,
        "seed": args.seed,
        **roofline(4),
        "tp": 4,
        "max_rows": 1024,  # verl's rollout max_num_seqs
        "kv_tokens": kv_budget(4),
        "per_call": False,
        "resume_prefill": 1.0,  # verl's pause clears the KV cache: a resumed row re-encodes its context
        "update_s_per_token": 0.0,
        "recompute_s_per_token": 0.0,
        "sync_recompute": True,
        "async_recompute": False,  # verl's async trainer uses the rollout log-probs (no old_log_prob)
        "amdahl": 0.0,
        "train_efficiency": 1.0,
        "push_s": 0.0,
        "quiesce": False,
        "max_staleness": 1,  # admit_groups takes whole versions: 0.5 rounds up
        "evict_staleness": None,  # verl keeps partial samples whatever their age
        "mode": "sync",
        "gen_gpus": 128,
        "train_gpus": 128,
        "groups_per_step": 512,
        "sync_interval": 1,
        "max_inflight": 1 << 30,
        "steps": args.verl_steps,
        "warmup": 1,
    }
    cfg.update(over)
    return SimpleNamespace(**cfg)


def async_over(cfg: SimpleNamespace) -> dict[str, Any]:
    """The fully-async 64:64 run as verl's rollouter runs it (``verl/experimental/fully_async_policy``,
    ``fully_async_rollouter.py``): 4 local updates of 128 prompts per sync; launches stop once
    ``(1 + staleness_threshold) x 4 x 128`` = 768 prompts were started past those the trainer had taken
    at the last sync (``max_required_samples``: the launch ceiling at staleness 1.5 versions); at most
    16 prompts in flight per vLLM server (``max_concurrent_samples``: 16 servers of TP4, 256); and a
    sync cancels every request and clears the KV cache, so a resumed row re-encodes its context."""
    return {
        "mode": "async",
        "gen_gpus": 64,
        "train_gpus": 64,
        "groups_per_step": 128,
        "sync_interval": 4,
        "staleness_fraction": 0.5,
        "max_inflight": 16 * 64 // cfg.tp,
        "resume_prefill": 1.0,
        "steps": 4 * cfg.steps,
        "warmup": 8,
    }


# the async run as this check modelled it before it followed verl's rollouter: staleness rounded up to a
# whole version, 768 prompts in flight, the KV cache kept across a push
EARLIER_ASYNC = {"staleness_fraction": None, "max_inflight": 768, "resume_prefill": 0.0}


LAWS = ("amdahl", "power", "perfect")


def with_law(
    cfg: SimpleNamespace, costs: dict[str, float], law: str, hw: str = "h20", model: str = "7b"
) -> SimpleNamespace:
    """Set how training scales with GPUs, the per-token costs fitted so that every law gives the
    published 128-GPU sync times: ``amdahl`` (``A + B/gpus`` through the 64- and 128-GPU sync rows),
    ``power`` (``gpus**e`` through the same two rows) or ``perfect`` (``1/gpus``). On ``hw`` the costs
    scale with peak FLOP/s, and for ``model`` with its parameters (the same MFU as the calibration's
    7B on H20s)."""
    f, e = costs["amdahl"], costs["power"]
    at128 = {"amdahl": 1 / (f + (1 - f) / 128), "power": 128**e, "perfect": 128.0}[law]
    per = at128 / costs["tokens_per_step"] * HARDWARE["h20"]["flops"] / HARDWARE[hw]["flops"]
    per *= MODELS[model]["params"] / QWEN_7B["params"]
    cfg.amdahl = f if law == "amdahl" else 0.0
    cfg.train_efficiency = e if law == "power" else 1.0
    cfg.update_s_per_token = PUBLISHED["sync_128"]["update_actor"] * per
    cfg.recompute_s_per_token = PUBLISHED["sync_128"]["old_log_prob"] * per
    return cfg


def phases(result: dict[str, Any], per: int) -> dict[str, float]:
    """Seconds per published step (``per`` simulated batches) by published phase."""
    p = {k: v * per for k, v in result["phases_s_per_batch"].items()}
    return {
        "step": result["s_per_batch"] * per,
        "gen": p["wait"],
        "old_log_prob": p["recompute"],
        "update_actor": p["update"],
        "other": p["push"] + p["quiesce"],
    }


def calibrate(args: Any) -> tuple[dict[str, float], SimpleNamespace]:
    """Calibrated costs (engine costs at tp=1 and tp=4 follow from ``scale``) and the calibrated verl config."""
    sync = PUBLISHED["sync_128"]
    overhead = getattr(args, "verl_sync_gen_overhead", 0.0)
    if not 0 <= overhead < sync["gen"]:
        raise ValueError(f"--verl-sync-gen-overhead {overhead} must be in [0, {sync['gen']}) seconds")
    probe = run(verl_cfg(args, update_s_per_token=1e-9))
    tokens_per_step = probe["trained_tokens_per_s"] * probe["s_per_batch"]
    # verl's colocated "gen" timer also wraps the engines' wake-up (the weights loaded into vLLM) and
    # sleep (``AgentLoopManager.generate_sequences`` at the docs' commit): seconds of it not decoding
    decoding = sync["gen"] - overhead
    scale = decoding / probe["phases_s_per_batch"]["wait"]
    engine = roofline(4, scale)
    if getattr(args, "verl_fit", "all") == "fixed":
        engine = {**roofline(4), "a": fixed_step_cost(args, decoding, roofline(4)["a"], engine["a"])}
    t64, t128 = PUBLISHED["sync_64"]["update_actor"], sync["update_actor"]
    serial = t128 - (t64 - t128)  # A in A + B/gpus: B/128 = t64 - t128
    costs = {
        "scale": scale,
        "amdahl": serial / (serial + (t64 - t128) * 128),  # A / T(1)
        "power": math.log(t64 / t128) / math.log(2),
        "push_s": sync["step"] - sync["gen"] - sync["old_log_prob"] - sync["update_actor"],
        "tokens_per_step": tokens_per_step,
    }
    costs["a_over_roofline"] = engine["a"] / roofline(4)["a"]
    cfg = with_law(verl_cfg(args, **engine, push_s=costs["push_s"]), costs, args.verl_law)
    return costs, cfg


def fixed_step_cost(args: Any, decoding: float, a0: float, a1: float) -> float:
    """``--verl-fit fixed``: the engine's fixed cost per decode step ``a`` that makes colocated sync on
    128 GPUs decode for ``decoding`` seconds, its per-row, per-context and prefill costs kept at the
    roofline (the least-known cost fitted alone, as the AReaL check does). The sync step's generation
    is the tail's, a few rows for thousands of steps, so it is near-linear in ``a``: secant steps from
    ``a0`` and ``a1``, to 0.1%."""

    def decode_s(a: float) -> float:
        return run(verl_cfg(args, **{**roofline(4), "a": a}, update_s_per_token=1e-9))["phases_s_per_batch"][
            "wait"
        ]

    points = [(a0, decode_s(a0)), (a1, decode_s(a1))]
    for _ in range(8):
        (x0, y0), (x1, y1) = points[-2:]
        if abs(y1 / decoding - 1) < 1e-3 or y1 == y0:
            break
        points.append((x2 := x1 + (decoding - y1) * (x1 - x0) / (y1 - y0), decode_s(x2)))
    return points[-1][0]


def async_step(cfg: SimpleNamespace, **over: Any) -> dict[str, float]:
    """The async run's phases (seconds per published step), ``over`` applied on top of :func:`async_over`."""
    return phases(run(SimpleNamespace(**{**vars(cfg), **async_over(cfg), **over})), 4)


def table(args: Any) -> tuple[dict[str, float], SimpleNamespace, list[dict[str, Any]], dict[str, Any]]:
    """Calibrate on sync, predict async 64:64: the calibrated costs and config, and the rows
    ``{mode, phase, published, simulated, error}`` (error relative to the published seconds), and the
    async run's occupancy, token staleness and group counts."""
    costs, cfg = calibrate(args)
    sync = phases(run(cfg), 1)
    raw = run(SimpleNamespace(**{**vars(cfg), **async_over(cfg)}))
    predicted = phases(raw, 4)
    rows = []
    for key in ("step", "gen", "old_log_prob", "update_actor", "other"):
        for mode, sim in (("sync_128", sync), ("async_64_64", predicted)):
            pub = PUBLISHED[mode]
            rest = pub["step"] - pub["gen"] - pub["old_log_prob"] - pub["update_actor"]
            published = rest if key == "other" else pub[key]
            error = (sim[key] - published) / published if published else None
            rows.append(
                {"mode": mode, "phase": key, "published": published, "simulated": sim[key], "error": error}
            )
    return costs, cfg, rows, {k: raw[k] for k in ("occupancy", "token_staleness", "groups")}


def reproduce(args: Any) -> dict[str, Any]:
    """The reproduction table, and how the predicted async step moves with each assumption."""
    costs, cfg, rows, async_run = table(args)
    published = PUBLISHED["async_64_64"]["step"]
    sensitivity = {}
    variants = {
        "training scales as a power law": {"law": "power"},
        "training scales perfectly": {"law": "perfect"},
        "as modelled before: staleness 1, 768 in flight, the KV cache kept": EARLIER_ASYNC,
        "evict by our runtime's rule (max_staleness 1)": {"evict_staleness": 1},
    }
    for name, over in variants.items():
        cfg2 = SimpleNamespace(**vars(cfg))
        if "law" in over:
            with_law(cfg2, costs, over["law"])
        got = async_step(cfg2, **{k: v for k, v in over.items() if k != "law"})
        sensitivity[name] = {"step": got["step"], "error": got["step"] / published - 1, "wait": got["gen"]}
    lengths = (
        {"verl_median_len": 600},
        {"verl_median_len": 2400},
        {"verl_median_len": 600, "verl_sigma": 1.2},
    )
    recalibrated = (
        {"seed": 1},
        {"seed": 2},
        *lengths,
        {"verl_sync_gen_overhead": 10.0},
        {"verl_fit": "fixed"},
    )
    for over in recalibrated:
        costs2, cfg2 = calibrate(SimpleNamespace(**{**vars(args), **over}))  # a new calibration
        got = async_step(cfg2)
        name = ", ".join(f"{k} {v}" for k, v in over.items())
        sensitivity[name] = {
            "step": got["step"],
            "error": got["step"] / published - 1,
            "wait": got["gen"],
            "implied_update_mfu": implied_mfu(costs2["tokens_per_step"]),
            "a_over_roofline": costs2["a_over_roofline"],
        }
    return {
        "source": SOURCE,
        "setting": SETTING,
        "published": PUBLISHED,
        "calibrated": costs,
        "implied_update_mfu": implied_mfu(costs["tokens_per_step"]),
        "table": rows,
        "async_run": async_run,
        "sensitivity": sensitivity,
    }


def implied_mfu(tokens_per_step: float) -> float:
    """The MFU the published 128-GPU update time implies for ``tokens_per_step`` (8 FLOPs per parameter
    per token: forward, checkpointed re-forward, backward): a check on the assumed lengths."""
    flops = 8 * QWEN_7B["params"] * tokens_per_step
    return flops / (128 * HARDWARE["h20"]["flops"] * PUBLISHED["sync_128"]["update_actor"])
