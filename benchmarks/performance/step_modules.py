"""How many of the package's modules one async RL step runs, after warm-up: a cProfile record of the
trainer process (the strategy, runtime, controller, loop, module, weight sync, callbacks) from the
start of step ``--from`` to the start of step ``--to`` of the tiny recipe (async, HF engine in a Ray
worker). The workers' own processes are not in it. Prints the modules and their count.

    python -m benchmarks.performance.step_modules [--steps 8] [--from 5] [--to 6] [--out step_modules]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import tempfile
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from benchmarks.harness import common

RECIPE = common.REPO / "examples" / "grpo_tiny.yaml"


class StepProfiler(Callback):
    """Profiles the trainer process between the starts of two RL steps."""

    def __init__(self, start: int, stop: int) -> None:
        self.start, self.stop = start, stop
        self.profile = cProfile.Profile()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.strategy.rl_steps
        if step == self.start:
            self.profile.enable()
        elif step == self.stop:
            self.profile.disable()


def package_modules(profile: cProfile.Profile, package: Path) -> list[str]:
    """The package's modules (dotted names) that have a function in ``profile``."""
    stats = pstats.Stats(profile)
    names = set()
    for filename, _, _ in stats.stats:  # type: ignore[attr-defined]
        path = Path(filename)
        if package in path.parents:
            parts = path.relative_to(package.parent).with_suffix("").parts
            names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


def run(config: dict) -> dict:
    from unirl_lightning.cli.app import run_cli

    profiler = StepProfiler(config["from_step"], config["to_step"])
    folder = tempfile.mkdtemp(prefix="step-modules-")
    args = ["fit", "--config", str(RECIPE), f"--trainer.max_steps={config['steps']}"]
    args += ["--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={folder}"]
    args += [f"--trainer.default_root_dir={folder}"]
    run_cli(args, trainer_defaults={"callbacks": [profiler]})
    import unirl_lightning

    modules = package_modules(profiler.profile, Path(unirl_lightning.__file__).resolve().parent)
    return {
        "recipe": RECIPE.name,
        "steps": [config["from_step"], config["to_step"]],
        "modules": modules,
        "count": len(modules),
    }


def main(argv: list[str] | None = None) -> int:
    parser = common.script_parser(__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--from", dest="from_step", type=int, default=5)
    parser.add_argument("--to", dest="to_step", type=int, default=6)
    parser.add_argument("--out", default="step_modules")
    config = common.parse_config(parser, argv)
    result = run(config)
    print("\n".join(result["modules"]))
    print(f"{result['count']} package modules ran in the trainer process during one RL step")
    if config["out"]:
        print(f"wrote {common.write_results(result, config['out'], config=config)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
