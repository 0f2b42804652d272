"""``unirl-lightning``: LightningCLI for RL recipes.

``unirl-lightning fit --config examples/grpo_tiny.yaml`` builds the trainer (strategy, callbacks,
logger), the module and the datamodule from YAML through ``class_path``/``init_args``; every knob
is an ``__init__`` argument with a type hint, so ``--print_config`` shows them all and an unknown
key, a wrong type or a value outside a ``Literal`` fails at parse time naming the key. After
parsing and before anything is built (no model, no Ray), the CLI also:

* rejects combinations that cannot work (e.g. colocated placement with async settings);
* imports every reward given as an import path, so a typo fails naming the key;
* resolves ``--ckpt_path last`` to the newest ``last*.ckpt`` of the run being resumed (under the
  logger's ``save_dir/name/*/checkpoints`` and every ``ModelCheckpoint`` ``dirpath``) and keeps
  logging into that run's folder; with none there it stops with an error instead of starting over;
* gives the trainer the RL progress bar.

``unirl-lightning export --config X.yaml --ckpt_path PATH --output DIR [--merge] [--overwrite]`` builds
the module from the same config (nothing else: no trainer, no Ray), loads the checkpoint's policy
(a ``.ckpt`` file or a sharded checkpoint folder; ``last`` as for ``fit``) and writes it in the
Hugging Face layout (:mod:`unirl_lightning.export`). The config may be the run's own saved
``config.yaml``.

``unirl-lightning validate --config X.yaml [--ckpt_path PATH]`` evaluates without training: the
fit config's trainer, module and datamodule are built, the checkpoint's policy (``last`` as for
``fit``) is loaded into the module before the rollout workers start (so they are pushed the
restored weights at the strategy's setup, at version 0), the trainer's ``RolloutEvalCallback`` (a
default one when it has none) evaluates the held-out prompts once, and the figures are printed as
one JSON line (``eval/reward_mean``, ``eval/accuracy``, ``eval/pass@k``, ``eval/mean@n``,
``eval/maj@n``, ...). Without ``--ckpt_path`` the initial model is evaluated.

``unirl-lightning plan --config X.yaml [--cluster 1x8x80] [--model_config DIR] [--output plan.json]``
parses the config as ``fit`` does and builds nothing (no model, no Ray): the setup rules ``fit`` runs,
the placement of ranks and workers on the declared cluster, and an estimate of each GPU's memory
(:mod:`unirl_lightning.plan`); it exits 1 naming the key when a check fails.

Errors exit with code 2 and a parser message. The console script keeps Ray's token authentication
on without its start-up warning (``RAY_AUTH_MODE=token`` unless set), and exits 143 on SIGTERM.
"""

from __future__ import annotations

import os

if not os.environ.get("RAY_ADDRESS"):  # before anything imports ray: it reads the mode at import
    os.environ.setdefault("RAY_AUTH_MODE", "token")

import importlib  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from jsonargparse import ActionYesNo, Namespace  # noqa: E402
from lightning.pytorch import LightningDataModule  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402
from lightning.pytorch.utilities.exceptions import SIGTERMException  # noqa: E402

from unirl_lightning.imports import import_callable  # noqa: E402
from unirl_lightning.modules.base import RLModule  # noqa: E402


def _strategy_settings(trainer: Any) -> dict[str, Any] | None:
    """The rollout settings of ``trainer.strategy`` when it is a rollout strategy given by class path,
    with the defaults for the keys not given; None otherwise."""
    from unirl_lightning.strategy import RolloutStrategyMixin

    node = trainer.get("strategy") if trainer is not None else None
    class_path = node.get("class_path") if hasattr(node, "get") else None
    if not class_path:
        return None
    module, _, name = class_path.rpartition(".")
    if not issubclass(getattr(importlib.import_module(module), name), RolloutStrategyMixin):
        return None
    given = node.get("init_args")
    given = dict(given.items()) if hasattr(given, "items") else vars(given or {})
    defaults = inspect.signature(RolloutStrategyMixin.init_rollout).parameters
    return {
        key: given.get(key, defaults[key].default)
        for key in ("placement", "max_staleness", "max_inflight", "weight_sync", "max_worker_restarts")
    }


def _import_class(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _nodes(node: Any, key: str):
    """Every (key, value) below ``node``, with dotted keys (lists as ``key.0``)."""
    yield key, node
    if isinstance(node, Namespace):
        for child, value in vars(node).items():
            yield from _nodes(value, f"{key}.{child}" if key else child)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _nodes(value, f"{key}.{index}")


def check_reward_paths(config: Any) -> None:
    """Import every reward function given as an import path in the model section (``reward: pkg.mod:f``,
    ``CallableReward(fn=...)``, ``CombinedReward(rewards=[...])``); raise ``ValueError`` naming the key."""
    model = config.get("model") if hasattr(config, "get") else None
    for key, value in _nodes(model, "model"):
        parts = key.split(".")
        is_path = parts[-1] in ("reward", "fn") or (len(parts) > 1 and parts[-2] == "rewards")
        if not (is_path and isinstance(value, str)):
            continue
        try:
            target = import_callable(value, key)
        except (ImportError, ValueError, TypeError) as exc:
            raise ValueError(f"{key}: cannot import {value!r}: {exc}") from None
        if isinstance(target, type):
            raise ValueError(
                f"{key}: {value!r} is a class; give a function path 'pkg.mod:func', or the reward class as "
                f"class_path (with init_args)"
            )


def resolve_last_checkpoint(config: Any) -> None:
    """``ckpt_path: last`` -> the newest ``last*.ckpt`` of this run, and the logger continues in that
    run's folder; ``FileNotFoundError`` naming where it looked when there is none."""
    if config.get("ckpt_path") != "last":
        return
    trainer = config.get("trainer")
    folders: list[tuple[Path, str | None]] = []  # (checkpoint folder, logger version it belongs to)
    for callback in trainer.get("callbacks") or []:
        class_path = callback.get("class_path", "")
        dirpath = callback.get("init_args", Namespace()).get("dirpath")
        if class_path and issubclass(_import_class(class_path), ModelCheckpoint) and dirpath:
            folders.append((Path(dirpath), None))
    logger = trainer.get("logger")
    root: Path | None = None
    if logger is None or logger is True:  # Lightning's default logger
        root = Path(trainer.get("default_root_dir") or os.getcwd()) / "lightning_logs"
    elif isinstance(logger, Namespace):
        args = logger.get("init_args", Namespace())
        save_dir = args.get("save_dir") or trainer.get("default_root_dir") or os.getcwd()
        root = Path(save_dir) / str(args.get("name") or "")
    if root is not None:
        folders += [(d, d.parent.name) for d in root.glob("*/checkpoints")]
    found = [(path, version) for folder, version in folders for path in folder.glob("last*.ckpt")]
    if not found:
        looked = [str(folder) for folder, _ in folders] or [str(root)]
        raise FileNotFoundError(
            f"ckpt_path: 'last' was given but there is no last*.ckpt in {looked}; omit --ckpt_path to start a new "
            "run, or give the checkpoint's path"
        )
    path, version = max(found, key=lambda item: item[0].stat().st_mtime)
    config["ckpt_path"] = str(path)
    if version is not None and isinstance(logger, Namespace) and logger.init_args.get("version") is None:
        logger.init_args["version"] = version  # log and checkpoint on in the resumed run's folder


def check_combinations(config: Any) -> None:
    """Reject configurations that parse but cannot run, before anything is built; the message names
    the keys (the rules are the strategy's own, :func:`check_rollout_settings`, and
    :func:`~unirl_lightning.preflight.sync_replacement_error`)."""
    from unirl_lightning.preflight import sync_replacement_error
    from unirl_lightning.runtime import check_rollout_settings

    trainer = config.get("trainer") if hasattr(config, "get") else None
    settings = _strategy_settings(trainer)
    if settings is None:
        return
    try:
        check_rollout_settings(**{k: settings[k] for k in ("placement", "max_staleness", "max_inflight")})
    except ValueError as exc:
        raise ValueError(f"trainer.strategy.init_args: {exc}") from None
    devices, nodes = trainer.get("devices"), int(trainer.get("num_nodes") or 1)
    world = (
        len(devices) if isinstance(devices, list) else int(devices) if str(devices).isdigit() else 1
    ) * nodes
    sharded = trainer.get("strategy").get("class_path") == "unirl_lightning.strategy.AsyncRolloutFSDPStrategy"
    error = sync_replacement_error(
        str(settings["weight_sync"]), sharded, world, int(settings["max_worker_restarts"])
    )
    if error is not None:
        raise ValueError(f"trainer.strategy.init_args: {error}")


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
        try:
            check_combinations(config)
            check_reward_paths(config)
            resolve_last_checkpoint(config)
        except (ValueError, FileNotFoundError) as exc:
            self.parser.error(str(exc))  # exit code 2 with the message, before anything is built
        add_rl_progress_bar(config)


class CheckpointCLI(UniRLCLI):
    """A subcommand outside Lightning's ``Trainer`` methods that reads a fit config and a checkpoint:
    the config parsed as ``fit`` parses it, plus ``--ckpt_path`` (and ``--weights_only``, accepted so
    that a run's saved ``config.yaml`` parses). Subclasses set :attr:`prog`, :attr:`description` and
    :attr:`ckpt_help` and may add arguments."""

    prog = "unirl-lightning"
    description = ""
    ckpt_help = ""

    def __init__(self, args: list[str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("parser_kwargs", {"prog": self.prog, "description": self.description})
        super().__init__(args=args, run=False, **kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument("--ckpt_path", type=str | None, default=None, help=self.ckpt_help)
        parser.add_argument(
            "--weights_only", type=bool | None, default=None, help="ignored (a fit config key)"
        )


class ExportCLI(CheckpointCLI):
    """``unirl-lightning export``: the fit config's module, a checkpoint's policy in it, written out.

    Parses the config as ``fit`` does (same checks, ``--ckpt_path last`` resolved the same way) plus
    ``--output``, ``--merge`` and ``--overwrite``; instantiates the module only (the trainer is not
    built, so a GPU recipe exports on a CPU machine), then :func:`unirl_lightning.export.export_checkpoint`.
    """

    prog = "unirl-lightning export"
    description = "Export a checkpoint's policy in the Hugging Face layout."
    ckpt_help = "a .ckpt file, a sharded checkpoint folder, or 'last' (the newest last*.ckpt of the run)"

    def add_arguments_to_parser(self, parser: Any) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_argument("--output", type=str | None, default=None, help="the directory to write")
        parser.add_argument(
            "--merge", action=ActionYesNo, default=False, help="LoRA: write the merged full model"
        )
        parser.add_argument(
            "--overwrite", action=ActionYesNo, default=False, help="replace a non-empty --output"
        )

    def before_instantiate_classes(self) -> None:
        from unirl_lightning.export import check_checkpoint_path, check_output

        config = self.config
        if not config.get("ckpt_path"):
            self.parser.error(
                "export needs --ckpt_path (a .ckpt file, a sharded checkpoint folder, or 'last')"
            )
        if not config.get("output"):
            self.parser.error("export needs --output (the directory to write)")
        super().before_instantiate_classes()  # the fit checks, and 'last' resolved
        try:
            check_checkpoint_path(config["ckpt_path"])
            check_output(config["output"], config["overwrite"])
            args = config.get("model", Namespace()).get("init_args")
            if (
                config["merge"]
                and isinstance(args, Namespace)
                and "lora" in args
                and args.get("lora") is None
            ):
                raise ValueError(
                    "--merge: the policy has no LoRA adapters (model.init_args.lora is not set), so its weights "
                    "are already the full model; export without --merge"
                )
        except (ValueError, FileNotFoundError, FileExistsError) as exc:
            self.parser.error(str(exc))

    def instantiate_classes(self) -> None:
        """The module only: no trainer, strategy, callbacks, logger or datamodule is built."""
        from lightning.pytorch.cli import LightningArgumentParser

        parser = LightningArgumentParser()
        parser.add_lightning_class_args(self.model_class, "model", subclass_mode=self.subclass_mode_model)
        config = parser.parse_object({"model": self.config["model"].as_dict()})
        self.model = parser.instantiate_classes(config)["model"]
        self.trainer = self.datamodule = None

    def export(self) -> Path:
        from unirl_lightning.export import export_checkpoint

        config = self.config
        try:
            return export_checkpoint(
                self.model,
                config["ckpt_path"],
                config["output"],
                merge=config["merge"],
                overwrite=config["overwrite"],
            )
        except (ValueError, KeyError, FileNotFoundError, FileExistsError) as exc:
            self.parser.error(str(exc.args[0]) if exc.args else str(exc))


def run_export(args: list[str]) -> Path:
    """``unirl-lightning export ARGS``: returns the directory written."""
    quiet_lightning_notices()
    log = logging.getLogger("unirl_lightning.export")
    if not log.handlers:
        log.addHandler(logging.StreamHandler())
        log.setLevel(logging.INFO)
    path = ExportCLI(args=args).export()
    print(f"Exported to {path}")
    return path


class ValidateCLI(CheckpointCLI):
    """``unirl-lightning validate``: the fit config's trainer, module and datamodule, a checkpoint's
    policy in the module, one held-out evaluation on the rollout workers (see the module docstring).

    Parses the config as ``fit`` does (same checks, ``--ckpt_path last`` resolved the same way).
    """

    prog = "unirl-lightning validate"
    description = "Evaluate a checkpoint (or the initial model) on the held-out prompts."
    ckpt_help = "a .ckpt file, a sharded checkpoint folder, or 'last'; none = the initial model"

    def before_instantiate_classes(self) -> None:
        from unirl_lightning.export import check_checkpoint_path

        super().before_instantiate_classes()  # the fit checks, and 'last' resolved
        if self.config.get("ckpt_path"):
            try:
                check_checkpoint_path(self.config["ckpt_path"])
            except (ValueError, FileNotFoundError) as exc:
                self.parser.error(str(exc))

    def validate(self) -> dict[str, float] | None:
        """Evaluate once; the figures on rank 0 (None on the other ranks)."""
        from unirl_lightning.callbacks import RolloutEvalCallback
        from unirl_lightning.export import load_policy_checkpoint

        trainer, model = self.trainer, self.model
        ckpt_path = self.config.get("ckpt_path")
        if ckpt_path:
            try:
                load_policy_checkpoint(model, ckpt_path)
            except (ValueError, KeyError, FileNotFoundError, RuntimeError) as exc:
                self.parser.error(str(exc.args[0]) if exc.args else str(exc))
        callback = next((c for c in trainer.callbacks if isinstance(c, RolloutEvalCallback)), None)
        if callback is None:
            callback = RolloutEvalCallback()
            trainer.callbacks.append(callback)
        callback.validate_only = True
        trainer.fit_loop.epoch_loop.max_steps = (
            0  # the strategy's setup (workers started and pushed), no training
        )
        try:
            trainer.fit(model, datamodule=self.datamodule)
        finally:
            shutdown = getattr(trainer.strategy, "shutdown", None)
            if callable(shutdown):
                shutdown()
        return callback.validated if trainer.is_global_zero else None


def run_validate(args: list[str]) -> dict[str, float] | None:
    """``unirl-lightning validate ARGS``: evaluate, print the figures as one JSON line (rank 0) and
    return them."""
    import unirl_lightning.strategy  # noqa: F401  registers "async_rollout" with Lightning

    quiet_lightning_notices()
    metrics = ValidateCLI(args=args).validate()
    if metrics is not None:
        print(json.dumps(metrics, sort_keys=True), flush=True)
    return metrics


class PlanCLI(CheckpointCLI):
    """``unirl-lightning plan``: the fit config parsed as ``fit`` parses it (same checks), nothing built;
    :func:`unirl_lightning.plan.plan_recipe` against ``--cluster`` (default: the config's
    ``# cluster:`` header line) with the model's shapes from ``--model_config`` (default:
    ``examples/model_configs/<model name>``)."""

    prog = "unirl-lightning plan"
    description = "Check a recipe against the cluster it names, without building anything."
    ckpt_help = "ignored (a fit config key)"

    def add_arguments_to_parser(self, parser: Any) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_argument(
            "--cluster", type=str | None, default=None, help="NODESxGPUSxGIB (e.g. 1x8x80) or cpu"
        )
        parser.add_argument(
            "--model_config",
            type=str | None,
            default=None,
            help="a folder with config.json and tokenizer_config.json",
        )
        parser.add_argument("--output", type=str | None, default=None, help="write the plan as JSON here")

    def before_instantiate_classes(self) -> None:
        config = self.config
        try:
            check_combinations(config)
            check_reward_paths(config)
        except ValueError as exc:
            self.plan_error = str(exc)  # a finding of the plan, reported with the rest
        else:
            self.plan_error = None

    def instantiate_classes(self) -> None:
        """Nothing is built."""
        self.model = self.trainer = self.datamodule = None

    def plan(self) -> dict[str, Any]:
        from unirl_lightning.plan import ModelShape, parse_cluster, plan_recipe

        config = self.config
        files = [str(path) for path in config.get("config") or []]
        cluster_text = config.get("cluster") or _header_cluster(files)
        if cluster_text is None:
            self.parser.error(
                "plan needs --cluster (NODESxGPUSxGIB, e.g. 1x8x80, or cpu) or a '# cluster:' header line"
            )
        try:
            cluster = parse_cluster(cluster_text)
        except ValueError as exc:
            self.parser.error(str(exc))
        plain = config.clone()
        plain.pop("config", None)
        data = _plain(plain)
        folder = config.get("model_config") or _bundled_model_config(data)
        shape = ModelShape.from_dir(folder) if folder else None
        result = plan_recipe(data, cluster, shape)
        if self.plan_error and not any(f["message"] in self.plan_error for f in result["findings"]):
            result["ok"] = False
            result["findings"].insert(0, {"level": "error", "key": "config", "message": self.plan_error})
        result["cluster"] = cluster_text
        result["model_config"] = str(folder) if folder else None
        if config.get("output"):
            Path(config["output"]).write_text(json.dumps(result, indent=2) + "\n")
        return result


def _plain(node: Any) -> Any:
    if isinstance(node, Namespace):
        return {key: _plain(value) for key, value in vars(node).items()}
    if isinstance(node, list | tuple):
        return [_plain(value) for value in node]
    if isinstance(node, Path):
        return str(node)
    return node if isinstance(node, str | int | float | bool | type(None) | dict) else str(node)


def _header_cluster(files: list[str]) -> str | None:
    """The ``# cluster: X`` line at the top of the last config file, or None."""
    for path in reversed(files):
        for line in Path(path).read_text().splitlines():
            if not line.startswith("#"):
                break
            if line.lower().startswith("# cluster:"):
                return line.split(":", 1)[1].strip()
    return None


MODEL_CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "model_configs"


def _bundled_model_config(config: dict[str, Any]) -> Path | None:
    """``examples/model_configs/<last part of the policy's name_or_path>`` when it exists."""
    policy = ((config.get("model") or {}).get("init_args") or {}).get("policy") or {}
    name = (policy.get("init_args") or {}).get("name_or_path")
    folder = MODEL_CONFIGS / str(name).rstrip("/").split("/")[-1] if name else None
    return folder if folder is not None and (folder / "config.json").is_file() else None


def format_plan(result: dict[str, Any]) -> str:
    """The plan as a table: findings, then the figures."""
    lines = [f"plan on {result['cluster']}: {'OK' if result['ok'] else 'FAILS'}"]
    for finding in result["findings"]:
        lines.append(f"  {finding['level']:<7} {finding['key']}: {finding['message']}")
    for name, figure in result["figures"].items():
        if isinstance(figure, dict):
            lines.append(f"  {name}:")
            lines += [f"    {key:<24} {value}" for key, value in figure.items()]
        else:
            lines.append(f"  {name:<26} {figure}")
    return "\n".join(lines)


def run_plan(args: list[str]) -> dict[str, Any]:
    """``unirl-lightning plan ARGS``: prints the plan; exits 1 when a check fails."""
    with warnings.catch_warnings():  # LightningCLI's note on args given beside sys.argv: main() passes them
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        result = PlanCLI(args=args).plan()
    print(format_plan(result))
    if not result["ok"]:
        sys.exit(1)
    return result


def run_cli(args: list[str] | None = None, **kwargs: Any) -> UniRLCLI:
    """Build and run the CLI; returns it (its ``trainer``, ``model``, ``datamodule``)."""
    import unirl_lightning.strategy  # noqa: F401  registers "async_rollout" with Lightning

    quiet_lightning_notices()
    return UniRLCLI(args=args, **kwargs)  # None: LightningCLI reads sys.argv itself


class _DropLightningTip(logging.Filter):
    """Lightning's advertisement for its cloud logger (printed on every run without one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


def quiet_lightning_notices() -> None:
    """Drop, by their exact text, three notices Lightning prints on every RL run that are not about the
    run: its cloud-logger advertisement, a torch deprecation inside Lightning's own code, and the
    manual-optimization note of ``ModelCheckpoint`` (we checkpoint after the step on purpose)."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropLightningTip())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")


def main(args: list[str] | None = None) -> None:
    """The ``unirl-lightning`` console script (``export``: :func:`run_export`, ``validate``:
    :func:`run_validate`, the rest: LightningCLI)."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["export"]:
        run_export(argv[1:])
        return
    if argv[:1] == ["plan"]:
        run_plan(argv[1:])
        return
    if argv[:1] == ["validate"]:
        try:
            run_validate(argv[1:])
        except SIGTERMException:
            sys.exit(143)
        return
    try:
        run_cli(args)
    except SIGTERMException:  # Lightning ends a SIGTERMed run with SystemExit(0): say it was killed
        sys.exit(143)


if __name__ == "__main__":
    main()
