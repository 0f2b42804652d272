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

import difflib  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, NoReturn  # noqa: E402

from jsonargparse import ActionYesNo, Namespace  # noqa: E402
from lightning.pytorch import LightningDataModule  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar  # noqa: E402
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI  # noqa: E402
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


def check_data_paths(config: Any) -> None:
    """A ``train`` / ``val`` prompt source of the data module that is neither a built-in task, nor
    ``hf:<id>``, nor an existing file or folder fails here, naming the key, before any run folder is
    made (``fit`` only: ``plan`` and ``export`` need no data)."""
    from unirl_lightning.data.tasks import BUILTIN_TASKS

    data = config.get("data") if hasattr(config, "get") else None
    args = data.get("init_args") if isinstance(data, Namespace) else None
    if not isinstance(args, Namespace):
        return
    for key in ("train", "val"):
        source = args.get(key)
        if not isinstance(source, str) or source in BUILTIN_TASKS or source.startswith("hf:"):
            continue
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"data.init_args.{key}: prompt source {source!r} is not an existing file or folder (looked at "
                f"{path.resolve()}), not 'hf:<id>' and not a built-in task ({', '.join(sorted(BUILTIN_TASKS))})"
            )


def refuse_cli_optimizers(config: Any) -> None:
    """LightningCLI's ``--optimizer`` / ``--lr_scheduler`` would replace the module's own AdamW (fp32
    masters, fused) and schedule; refuse them naming the module's keys."""
    if config.get("optimizer") is not None:
        raise ValueError(
            "--optimizer is not used by the RL modules (their AdamW keeps fp32 masters and is fused where it "
            "can be): set model.init_args.lr, model.init_args.weight_decay and model.init_args.betas"
        )
    if config.get("lr_scheduler") is not None:
        raise ValueError(
            "--lr_scheduler is not used by the RL modules: set model.init_args.lr_schedule (one of "
            "'constant', 'linear', 'cosine') and model.init_args.warmup_steps (optimizer steps)"
        )


SECTIONS = (
    ("unirl_lightning.engines.base", "EngineConfig", "trainer.strategy.init_args.engine.init_args."),
    ("unirl_lightning.strategy", "RolloutStrategyMixin", "trainer.strategy.init_args."),
    ("unirl_lightning.modules.base", "RLModule", "model.init_args."),
    ("lightning.pytorch", "LightningDataModule", "data.init_args."),
    ("lightning.pytorch.callbacks", "Callback", "trainer.callbacks: "),
)
"""Where a class's ``__init__`` arguments sit in a fit config, by base class (most specific first)."""


def config_error(exc: BaseException) -> str | None:
    """The message of the check that refused a value during instantiation, with the config key it sits
    under (``model.init_args.``, ``data.init_args.``, ...), or None when no error of the chain came from
    a class's ``__init__`` in a config section (a bug, not a config value)."""
    chain, seen = [], set()
    pending = [exc]
    while pending:  # jsonargparse chains the error of each Union branch it tried
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        chain.append(current)
        pending += [current.__context__, current.__cause__]
    bases = [(getattr(importlib.import_module(m), c), prefix) for m, c, prefix in SECTIONS]
    for error in chain:
        if not isinstance(error, ValueError | TypeError):
            continue
        for frame, _ in traceback.walk_tb(error.__traceback__):
            owner = frame.f_locals.get("self")
            if frame.f_code.co_name not in ("__init__", "__post_init__") or owner is None:
                continue
            prefix = next((prefix for base, prefix in bases if isinstance(owner, base)), None)
            if prefix is not None:
                text = str(error).splitlines()[0] if str(error) else type(error).__name__
                return _keyed(text, type(owner), prefix)
    # a Union (``trainer.strategy: str | Strategy``) reports its branches' errors in its message only
    message = str(exc)
    named = re.search(r"class_path='([\w.]+)'", message)
    reasons = [line.strip()[2:] for line in message.splitlines() if line.strip().startswith("- ")]
    reasons = [r for r in reasons if not r.startswith("Expected a ")]
    if named and reasons:
        try:
            owner_cls = _import_class(named[1])
        except (ImportError, AttributeError, ValueError):
            return None
        prefix = next((prefix for base, prefix in bases if issubclass(owner_cls, base)), None)
        if prefix is not None:
            return _keyed(reasons[0], owner_cls, prefix)
    return None


def _keyed(text: str, owner: type, prefix: str) -> str:
    """``text`` under the config key of the argument of class ``owner`` it names."""
    if prefix.endswith(": "):
        return f"{prefix}{owner.__name__}: {text}"
    keys = _init_keywords(f"{owner.__module__}.{owner.__qualname__}")
    if text.split(" ", 1)[0] in keys:
        return f"{prefix}{text}"
    named = next((k for k in keys if re.search(rf"\b{re.escape(k)}=", text)), None)
    return f"{prefix}{named}: {text}" if named else f"{prefix.rstrip('.')}: {text}"


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


def summarize_parse_error(message: str) -> str | None:
    """One line for jsonargparse's nested message: the full key and what was wrong, with the accepted
    keys closest to a misspelled one (``difflib``) and the classes a module offers for an unknown
    ``class_path``; None when the message has no such structure."""
    lines = [line.strip() for line in message.splitlines()]
    outer = re.match(r'Parser key "([^"]+)":', lines[0]) if lines else None
    problem = next(
        (i for i, line in enumerate(lines) if line.startswith("- Problem with given class_path")), None
    )
    if outer is None or problem is None or problem + 1 >= len(lines):
        return None
    section = outer[1]
    class_path = re.search(r"class_path '([^']+)'", lines[problem])[1]
    detail = lines[problem + 1]
    inner = re.match(r'Parser key "([^"]+)":', detail)
    if inner:
        key = f"{section}.init_args.{inner[1]}"
        reasons = [
            line.lstrip("- ") for line in lines[problem + 2 :] if line and not line.startswith("Given value")
        ]
        literal = next((r for r in reasons if "Literal[" in r), None)
        if literal is not None:
            choices = re.search(r"Literal\[([^\]]*)\]", literal)[1]
            value = next(
                (r.split(": ", 1)[1] for r in reasons if r.startswith("Expected a dot import path")), None
            )
            got = f", got {value!r}" if value else ""
            return (
                f"{key}: expected one of [{choices}] or a class_path{got}" if value else f"{key}: {literal}"
            )
        return f"{key}: {reasons[0] if reasons else 'invalid value'}"
    option = re.match(r"Option '([^']+)' is not accepted", detail)
    if option:
        key = f"{section}.init_args.{option[1]}"
        accepted = _init_keywords(class_path)
        close = difflib.get_close_matches(option[1], accepted, n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        return f"{key}: {class_path.rsplit('.', 1)[-1]} has no setting {option[1]!r}{hint}"
    missing = re.match(r"module '([^']+)' has no attribute '([^']+)'", detail)
    if missing:
        module = importlib.import_module(missing[1])
        names = sorted(n for n in getattr(module, "__all__", dir(module)) if n[:1].isupper())
        close = difflib.get_close_matches(missing[2], names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"{section}.class_path: {missing[1]} has no class {missing[2]!r}{hint} Classes there: {', '.join(names)}"
    return f"{section}: {detail}"


def _init_keywords(class_path: str) -> list[str]:
    """The keyword arguments ``class_path``'s ``__init__`` accepts, those its ``**kwargs`` pass to its
    bases included."""
    try:
        cls = _import_class(class_path)
    except (ImportError, AttributeError, ValueError):
        return []
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__") or klass.__dict__.get("init_rollout")  # a strategy's **rollout
        if init is None:
            continue
        names += [
            n
            for n, p in inspect.signature(init).parameters.items()
            if n != "self" and p.kind != p.VAR_KEYWORD
        ]
    return sorted(set(names))


class RLArgumentParser(LightningArgumentParser):
    """Lightning's parser whose error messages end with one line naming the key (:func:`summarize_parse_error`)."""

    def error(self, message: str, *args: Any, **kwargs: Any) -> NoReturn:
        summary = summarize_parse_error(str(message))
        if summary is not None:
            message = f"{message}\n{summary}"
        super().error(message, *args, **kwargs)


class UniRLCLI(LightningCLI):
    """LightningCLI with RL modules and datamodules in subclass mode."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", RLArgumentParser)
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
            refuse_cli_optimizers(config)
            if subcommand == "fit":
                check_data_paths(config)
            resolve_last_checkpoint(config)
        except (ValueError, FileNotFoundError) as exc:
            self.parser.error(str(exc))  # exit code 2 with the message, before anything is built
        add_rl_progress_bar(config)

    def instantiate_classes(self) -> None:
        """Lightning's instantiation; a value a class refuses (``ValueError``/``TypeError`` from its
        checks) exits 2 with one last line naming the key: ``model.init_args.num_generations must be
        >= 1, got -4`` (:func:`config_error`)."""
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as exc:
            message = config_error(exc)
            if message is None:
                raise
            self.parser.error(message)


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
    quiet_lightning_notices()
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
    # our verbs hand their own argv to LightningCLI, which warns when sys.argv holds arguments too
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run")


VERBS = {
    "fit": "train a recipe: --config X.yaml (--print_config shows every setting; --ckpt_path last resumes)",
    "plan": "check a recipe against its cluster (rules, placement, memory per GPU) without building anything",
    "validate": "evaluate a checkpoint (or the initial model) on the held-out prompts: one JSON line",
    "export": "write a checkpoint's policy as a Hugging Face folder (LoRA adapter, or --merge)",
    "test, predict": "Lightning's verbs; the RL modules define no test or predict step",
}


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
    :func:`run_validate`, ``plan``: :func:`run_plan`, the rest: LightningCLI)."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] in ([], ["-h"], ["--help"]):
        print_verbs()
        return
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
