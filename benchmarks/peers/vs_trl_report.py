"""The analysis and figure of ``vs_trl.py``: medians and ranges over runs, the ratios against TRL, the
table, the plot (``python -m benchmarks.harness.plot`` redraws it from the results JSON). A helper module (no
``main``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness import figures, stats

COLORS = {
    "trl-1t": "#c9ccd1",
    "trl-2t": "#9aa5b1",
    "sync": "#8fb8f0",
    "sync-2t": "#2f80ed",
    "async": "#27ae60",
    "trl-defaults": "#e0e3e7",
    "hybrid": "#f2c94c",
    "hybrid-2t": "#f2994a",
}


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
                "steps_per_s": stats.spread([r["steps_per_s"] for r in mine]),
                "completions_per_s": stats.spread([r["completions_per_s"] for r in mine]),
                "tokens_per_s": stats.spread([r["tokens_per_s"] for r in mine]),
                "generate_s": stats.spread([r["generate_s"] for r in mine])["median"],
                "train_s": stats.spread([r.get("train_s") for r in mine])["median"],
                "sync_s": stats.spread([r.get("sync_s") for r in mine])["median"],
                "sync_share": stats.spread([r.get("sync_share") for r in mine])["median"],
                "tokens_per_step": tokens,
                "prompt_tokens_per_step": sorted(
                    {t for r in mine for t in r.get("prompt_tokens_per_step", [])}
                ),
                "runs": len(mine),
            }

        def best_trl(key: str, rows: dict[str, Any] = rows) -> float | None:
            # TRL as a speed comparison runs it: activation checkpointing off (not trl-defaults)
            return max(
                (rows[n][key]["median"] for n in rows if n.startswith("trl") and n != "trl-defaults"),
                default=None,
            )

        def ratio(
            name: str, base: float | None, key: str = "completions_per_s", rows: dict[str, Any] = rows
        ) -> float | None:
            if name not in rows or not base:
                return None
            return round(rows[name][key]["median"] / base, 3)

        best, best_tokens = best_trl("completions_per_s"), best_trl("tokens_per_s")
        sync_base = rows["sync"]["completions_per_s"]["median"] if "sync" in rows else None
        all_tokens = sorted({t for row in rows.values() for t in row["tokens_per_step"]})
        all_prompt = sorted({t for row in rows.values() for t in row["prompt_tokens_per_step"]})
        summary[workload] = {
            "configs": rows,
            "best_trl_completions_per_s": best,
            "sync_vs_best_trl": ratio("sync", best),
            "sync_2t_vs_best_trl": ratio("sync-2t", best),
            "async_vs_best_trl": ratio("async", best),
            "async_vs_sync": ratio("async", sync_base),
            # per completion token (what counts when EOS ends completions at different lengths)
            "best_trl_tokens_per_s": best_tokens,
            "sync_tokens_vs_best_trl": ratio("sync", best_tokens, "tokens_per_s"),
            "sync_2t_tokens_vs_best_trl": ratio("sync-2t", best_tokens, "tokens_per_s"),
            "async_tokens_vs_best_trl": ratio("async", best_tokens, "tokens_per_s"),
            "hybrid_tokens_vs_best_trl": ratio("hybrid", best_tokens, "tokens_per_s"),
            "hybrid_2t_tokens_vs_best_trl": ratio("hybrid-2t", best_tokens, "tokens_per_s"),
            "trl_defaults_tokens_vs_best_trl": ratio("trl-defaults", best_tokens, "tokens_per_s"),
            "tokens_per_step": all_tokens,
            "tokens_equal": len(all_tokens) == 1,
            "prompt_tokens_per_step": all_prompt,
        }
    return summary


def final_line(summary: dict[str, Any]) -> dict[str, Any]:
    """The per-workload figures of the final JSON line."""
    keys = ("sync_vs_best_trl", "async_vs_best_trl", "async_vs_sync")
    keys += ("sync_tokens_vs_best_trl", "sync_2t_tokens_vs_best_trl", "async_tokens_vs_best_trl")
    keys += ("hybrid_tokens_vs_best_trl", "hybrid_2t_tokens_vs_best_trl")
    return {
        workload: {
            "completions_per_s": {n: c["completions_per_s"]["median"] for n, c in s["configs"].items()},
            **{k: s[k] for k in keys},
        }
        for workload, s in summary.items()
    }


def lengths(tokens: list[int]) -> str:
    """The distinct tokens-per-step counts (a range when natural stopping makes them many)."""
    return ",".join(map(str, tokens)) if len(tokens) <= 3 else f"{min(tokens)}-{max(tokens)}"


def print_table(summary: dict[str, Any]) -> None:
    header = (
        f"{'workload':<8} {'config':<8} {'steps/s':>8} {'range':>13} {'compl/s':>8} {'vs TRL':>7} "
        f"{'tok/s':>7} {'vs TRL':>7} {'gen s':>6} {'train s':>7} {'sync s':>7} {'tokens/step':>11}"
    )
    print(header)
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for workload, s in summary.items():
        best, best_tokens = s["best_trl_completions_per_s"], s["best_trl_tokens_per_s"]
        for name, row in s["configs"].items():
            sps = row["steps_per_s"]
            cps = row["completions_per_s"]["median"]
            vs = f"{cps / best:.2f}x" if best else "-"
            tps = row["tokens_per_s"]["median"]
            vs_tokens = f"{tps / best_tokens:.2f}x" if best_tokens else "-"
            print(
                f"{workload:<8} {name:<8} {sps['median']:>8.3f} {sps['min']:>6.2f}-{sps['max']:<6.2f} "
                f"{cps:>8.1f} {vs:>7} {tps:>7.0f} {vs_tokens:>7} {fmt(row['generate_s']):>6} {fmt(row['train_s']):>7} "
                f"{fmt(row['sync_s']):>7} {lengths(row['tokens_per_step']):>11}"
            )


def plot(results: dict[str, Any], path: Path) -> None:
    """Completions/s (natural stopping: completion tokens/s) per configuration and workload (median,
    bars = range over runs)."""
    from benchmarks.peers.vs_trl import WORKLOADS

    summary = results["summary"]
    fig, axes = figures.pyplot().subplots(1, len(summary), figsize=(5 * len(summary), 3.4), squeeze=False)
    natural = results["config"].get("stopping", "suppressed") != "suppressed"
    key = "tokens_per_s" if natural else "completions_per_s"
    for ax, (workload, s) in zip(axes[0], summary.items()):
        names = list(s["configs"])
        med = [s["configs"][n][key]["median"] for n in names]
        lo = [m - s["configs"][n][key]["min"] for m, n in zip(med, names)]
        hi = [s["configs"][n][key]["max"] - m for m, n in zip(med, names)]
        drawn = ax.bar(names, med, yerr=[lo, hi], capsize=3, color=[COLORS.get(n, "#777") for n in names])
        ax.bar_label(drawn, fmt="%.0f", padding=2)
        tokens = lengths(s["tokens_per_step"])
        ax.set_title(f"{workload}: {WORKLOADS.get(workload, '?')} new tokens ({tokens} tok/step)", fontsize=9)
        ax.set_ylabel(key.replace("_per_s", " / s").replace("_", " "))
        ax.grid(axis="y", alpha=0.3)
    stopping = "natural stopping (EOS ends completions)" if natural else "EOS suppressed"
    fig.suptitle(
        f"GRPO vs TRL {results['config'].get('trl', '')} GRPOTrainer, 2 CPU cores\n{stopping}", fontsize=9
    )
    figures.save_figure(fig, path)
