"""A CLI that validates a recipe's keys and types but builds nothing (GPU recipes name hub models)."""

from __future__ import annotations

from unirl_lightning.cli.app import UniRLCLI


class ParseOnlyCLI(UniRLCLI):
    def instantiate_classes(self) -> None:
        pass


def init_args(node):
    """``init_args`` of a ``class_path`` node, or the node itself (dataclass-typed values)."""
    return getattr(node, "init_args", node)
