"""``unirl-lightning``: LightningCLI for RL recipes.

``unirl-lightning fit --config examples/grpo_tiny.yaml`` builds the trainer (strategy, callbacks,
logger), the module and the datamodule from YAML through ``class_path``/``init_args``; every knob
is an ``__init__`` argument with a type hint, so ``--print_config`` shows them all and an unknown
key or a wrong type fails at parse time naming the key. Combinations that cannot work (e.g.
colocated placement with async settings) are rejected before anything is instantiated.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch import LightningDataModule
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI

from unirl_lightning.modules.base import RLModule


def _strategy_settings(trainer: Any) -> dict[str, Any] | None:
    """The rollout settings of ``trainer.strategy`` when it is an AsyncRolloutStrategy given by
    class path, with the constructor's defaults for the keys not given; None otherwise."""
    from unirl_lightning.strategy import AsyncRolloutStrategy

    node = trainer.get("strategy") if trainer is not None else None
    class_path = node.get("class_path") if hasattr(node, "get") else None
    if not class_path:
        return None
    module, _, name = class_path.rpartition(".")
    if not issubclass(getattr(importlib.import_module(module), name), AsyncRolloutStrategy):
        return None
    given = node.get("init_args")
    given = dict(given.items()) if hasattr(given, "items") else vars(given or {})
    defaults = inspect.signature(AsyncRolloutStrategy.__init__).parameters
    return {
        key: given.get(key, defaults[key].default) for key in ("placement", "max_staleness", "max_inflight")
    }


def check_combinations(config: Any) -> None:
    """Reject configurations that parse but cannot run, before anything is built; the message names
    the keys (the rules are the strategy's own, :func:`check_rollout_settings`)."""
    from unirl_lightning.strategy import check_rollout_settings

    trainer = config.get("trainer") if hasattr(config, "get") else None
    settings = _strategy_settings(trainer)
    if settings is None:
        return
    try:
        check_rollout_settings(**settings)
    except ValueError as exc:
        raise ValueError(f"trainer.strategy.init_args: {exc}") from None


def add_rl_progress_bar(config: Any) -> None:
    """Give the trainer the RL progress bar (RL steps, no ``v_num``) in place of Lightning's default,
    unless the bar is off or the config names a progress bar of its own."""
    trainer = config.get("trainer") if hasattr(config, "get") else None
    if trainer is None or trainer.get("enable_progress_bar") is False:
        return
    callbacks = trainer.get("callbacks") or []
    for callback in callbacks:
        module, _, name = str(callback.get("class_path", "")).rpartition(".")
        if module and issubclass(getattr(importlib.import_module(module), name), ProgressBar):
            return
    bar = "RLRichProgressBar" if importlib.util.find_spec("rich") else "RLProgressBar"
    trainer["callbacks"] = [
        *callbacks,
        Namespace(class_path=f"unirl_lightning.callbacks.{bar}", init_args=Namespace()),
    ]


class UniRLCLI(LightningCLI):
    """LightningCLI with RL modules and datamodules in subclass mode."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("model_class", RLModule)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("datamodule_class", LightningDataModule)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(*args, **kwargs)

    def before_instantiate_classes(self) -> None:
        subcommand = self.config.get("subcommand")
        config = self.config.get(subcommand) if subcommand else self.config
        check_combinations(config)
        add_rl_progress_bar(config)


def run_cli(args: list[str] | None = None, **kwargs: Any) -> UniRLCLI:
    """Build and run the CLI; returns it (its ``trainer``, ``model``, ``datamodule``)."""
    import unirl_lightning.strategy  # noqa: F401  registers "async_rollout" with Lightning

    return UniRLCLI(args=args, **kwargs)  # None: LightningCLI reads sys.argv itself


def main(args: list[str] | None = None) -> None:
    """The ``unirl-lightning`` console script."""
    run_cli(args)


if __name__ == "__main__":
    main()
