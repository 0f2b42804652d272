"""The main demo: a tiny GRPO run on CPU that learns, logged to TensorBoard.

``make demo`` (or ``unirl-lightning demo``) runs ``examples/grpo_tiny.yaml`` through the
``unirl-lightning`` CLI, reads the TensorBoard logs back, draws ``reward_curve.png`` next to them,
and the run's ``timeline.json`` (generation, waits, training steps and weight syncs, per track) as
``timeline.png``, prints held-out accuracy before and after, and ends with one JSON line::

    {"eval_accuracy_start": ..., "eval_accuracy_end": ..., "steps": ..., "wall_s": ..., "log_dir": ...,
     "reward_curve": ..., "timeline": ...}

Extra arguments are passed to the CLI (e.g. ``--trainer.max_steps 40``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    from unirl_lightning.cli.app import run_cli
    from unirl_lightning.cli.curves import plot_curves, read_scalars
    from unirl_lightning.cli.recipes import recipes_dir
    from unirl_lightning.core.timeline import gantt, read_trace

    argv = list(sys.argv[1:] if argv is None else argv)
    folder = recipes_dir()
    if folder is None or not (folder / "grpo_tiny.yaml").is_file():
        raise FileNotFoundError(
            "the demo recipe grpo_tiny.yaml is missing: a broken install (reinstall unirl-lightning)"
        )
    recipe = folder / "grpo_tiny.yaml"
    start = time.perf_counter()
    cli = run_cli(["fit", "--config", str(recipe), *argv])
    wall_s = time.perf_counter() - start
    trainer = cli.trainer
    cli.trainer.strategy.shutdown()
    log_dir = Path(trainer.logger.log_dir)
    scalars = read_scalars(log_dir)
    accuracy = [v for _, v in scalars["eval/accuracy"]]
    curve = plot_curves(
        scalars,
        ["rollout/reward_mean", "eval/accuracy"],
        log_dir / "reward_curve.png",
        "GRPO on a tiny Llama (CPU)",
    )
    timeline = gantt(
        read_trace(log_dir / "timeline.json"), log_dir / "timeline.png", "GRPO on a tiny Llama: timeline"
    )
    summary = {
        "eval_accuracy_start": accuracy[0],
        "eval_accuracy_end": accuracy[-1],
        "steps": int(trainer.global_step),
        "wall_s": round(wall_s, 1),
        "log_dir": str(log_dir),
        "reward_curve": str(curve),
        "timeline": str(timeline),
    }
    print(
        f"held-out accuracy: {accuracy[0]:.3f} before training -> {accuracy[-1]:.3f} after {summary['steps']} steps"
    )
    print(
        f"TensorBoard: tensorboard --logdir {log_dir.parent}    reward curve: {curve}    timeline: {timeline}"
    )
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
