"""The ``unirl-lightning`` command's verbs and its entry point: ``export``, ``validate``, ``plan`` and
``demo`` are ours (:mod:`unirl_lightning.cli.app`, :mod:`unirl_lightning.cli.demo`), the rest is
LightningCLI. An unknown verb exits 2 naming every verb."""

from __future__ import annotations

import difflib
import sys

from lightning.pytorch.utilities.exceptions import SIGTERMException

from unirl_lightning.cli.app import run_cli, run_export, run_plan, run_validate
from unirl_lightning.cli.recipes import print_recipes, resolve_config_names

VERBS = {
    "fit": "train a recipe: --config X.yaml (--print_config shows every setting; --ckpt_path last resumes)",
    "plan": "check a recipe against its cluster (rules, placement, memory per GPU) without building anything",
    "validate": "evaluate a checkpoint (or the initial model) on the held-out prompts: one JSON line",
    "export": "write a checkpoint's policy as a Hugging Face folder (LoRA adapter, or --merge)",
    "demo": "the tiny GRPO run on CPU that learns (recipe grpo_tiny), its curves drawn",
    "recipes": "list the bundled recipes; any verb takes one by name: --config grpo_tiny",
    "test, predict": "Lightning's verbs; the RL modules define no test or predict step",
}

VERB_NAMES = ["fit", "plan", "validate", "export", "demo", "recipes", "test", "predict"]


def print_verbs() -> None:
    print("usage: unirl-lightning VERB --config X.yaml [...]\n\nverbs:")
    for verb, text in VERBS.items():
        print(f"  {verb:<14} {text}")
    print(
        "\nEach verb has its --help; the settings of a module: unirl-lightning fit --config X.yaml "
        "--model.help GRPOModule (strategies: --trainer.strategy.help AsyncRolloutStrategy)."
    )


def main(args: list[str] | None = None) -> None:
    """The ``unirl-lightning`` console script (``export``: :func:`run_export`, ``validate``:
    :func:`run_validate`, ``plan``: :func:`run_plan`, ``demo``: :func:`unirl_lightning.cli.demo.main`,
    the rest: LightningCLI)."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] in ([], ["-h"], ["--help"]):
        print_verbs()
        return
    if argv and not argv[0].startswith("-") and argv[0] not in VERB_NAMES:
        close = difflib.get_close_matches(argv[0], VERB_NAMES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(f"usage: unirl-lightning {{{','.join(VERB_NAMES)}}} --config X.yaml [...]", file=sys.stderr)
        print(f"error: unknown verb {argv[0]!r} (choose from {', '.join(VERB_NAMES)}){hint}", file=sys.stderr)
        sys.exit(2)
    argv = resolve_config_names(argv)  # --config grpo_tiny: a bundled recipe by name
    if argv[:1] == ["recipes"]:
        print_recipes()
        return
    if argv[:1] == ["export"]:
        run_export(argv[1:])
        return
    if argv[:1] == ["plan"]:
        run_plan(argv[1:])
        return
    if argv[:1] == ["demo"]:
        from unirl_lightning.cli.demo import main as demo

        demo(argv[1:])
        return
    if argv[:1] == ["validate"]:
        try:
            run_validate(argv[1:])
        except SIGTERMException:
            sys.exit(143)
        return
    try:
        run_cli(argv)
    except SIGTERMException:  # Lightning ends a SIGTERMed run with SystemExit(0): say it was killed
        sys.exit(143)
