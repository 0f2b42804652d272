"""The ``unirl-lightning`` command: ``fit`` / ``validate`` / ``export`` / ``plan`` / ``demo`` through
LightningCLI (:mod:`~unirl_lightning.cli.app`), the parse-time checks of a recipe
(:mod:`~unirl_lightning.cli.config`), errors that name the key (:mod:`~unirl_lightning.cli.errors`), the
plan's printout (:mod:`~unirl_lightning.cli.plan`) and the demo (:mod:`~unirl_lightning.cli.demo`)."""

from __future__ import annotations

from typing import Any


def main(args: list[str] | None = None) -> None:
    """The console script's entry point (``unirl-lightning``)."""
    from unirl_lightning.cli.verbs import main as app_main

    app_main(args)


def __getattr__(name: str) -> Any:
    # the former ``unirl_lightning.cli`` module's names (run_cli, UniRLCLI, ...), lazily
    if name.startswith("__"):
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module("unirl_lightning.cli.app"), name)
