"""``unirl-lightning``: LightningCLI for RL recipes.

``unirl-lightning fit --config examples/grpo_tiny.yaml`` builds the trainer (strategy, callbacks,
logger), the module and the datamodule from YAML through ``class_path``/``init_args``; every knob
is an ``__init__`` argument with a type hint, so ``--print_config`` shows them all and an unknown
key or a wrong type fails at parse time naming the key. Combinations that cannot work (e.g.
colocated placement with async settings) are rejected before anything is instantiated.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI

from unirl_lightning.modules.base import RLModule


def _init_args(node: Any) -> dict[str, Any]:
    if node is None or isinstance(node, str):
        return {}
    getter = node.get if hasattr(node, "get") else lambda k, d=None: getattr(node, k, d)
    args = getter("init_args", None)
    if args is None:
        return {}
    return dict(args.items()) if hasattr(args, "items") else vars(args)


def check_combinations(config: Any) -> None:
    """Reject configurations that parse but cannot run; the message names the keys."""
    trainer = config.get("trainer") if hasattr(config, "get") else None
    if trainer is None:
        return
    strategy = _init_args(trainer.get("strategy"))
    placement = strategy.get("placement", "separate")
    max_staleness, max_inflight = strategy.get("max_staleness", 1), strategy.get("max_inflight", 2)
    if placement == "colocate" and (max_staleness > 0 or max_inflight > 1):
        raise ValueError(
            "trainer.strategy.init_args.placement=colocate cannot overlap generation and training: it needs "
            f"max_staleness: 0 and max_inflight: 1 (got {max_staleness} and {max_inflight}); use placement: separate"
        )


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
        check_combinations(self.config.get(subcommand) if subcommand else self.config)


def run_cli(args: list[str] | None = None, **kwargs: Any) -> UniRLCLI:
    """Build and run the CLI; returns it (its ``trainer``, ``model``, ``datamodule``)."""
    import unirl_lightning.strategy  # noqa: F401  registers "async_rollout" with Lightning

    return UniRLCLI(args=args, **kwargs)  # None: LightningCLI reads sys.argv itself


def main(args: list[str] | None = None) -> None:
    """The ``unirl-lightning`` console script."""
    run_cli(args)


if __name__ == "__main__":
    main()
