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
Hugging Face layout (:mod:`unirl_lightning.models.export`). The config may be the run's own saved
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
(:mod:`unirl_lightning.planning.plan`); it exits 1 naming the key when a check fails.

Errors exit with code 2 and a parser message. The console script keeps Ray's token authentication
on without its start-up warning (``RAY_AUTH_MODE=token`` unless set), and exits 143 on SIGTERM.
"""

from __future__ import annotations

import os

if not os.environ.get("RAY_ADDRESS"):  # before anything imports ray: it reads the mode at import
    os.environ.setdefault("RAY_AUTH_MODE", "token")

import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from jsonargparse import ActionYesNo, Namespace  # noqa: E402
from lightning.pytorch import LightningDataModule  # noqa: E402
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI  # noqa: E402
from lightning.pytorch.utilities import rank_zero_warn  # noqa: E402

from unirl_lightning.cli.config import (  # noqa: E402
    FIT_MISSING_LAST,
    add_rl_progress_bar,
    check_combinations,
    check_data_paths,
    check_reward_paths,
    check_rollout_combinations,
    checkpoint_hyperparameters,
    checkpoint_overrides,
    drop_disabled_checkpoints,
    resolve_last_checkpoint,
)
from unirl_lightning.cli.errors import RLArgumentParser, config_error  # noqa: E402
from unirl_lightning.cli.flags import refuse_cli_optimizers, refuse_trainer_flags  # noqa: E402
from unirl_lightning.cli.plan import bundled_model_config, format_plan, plain_data  # noqa: E402
from unirl_lightning.cli.recipes import header_cluster  # noqa: E402
from unirl_lightning.modules.base import RLModule  # noqa: E402

FIT_SETTINGS_HELP = (
    "RL settings. Each class in a recipe lists its own settings, with their help and defaults: "
    "--model.help GRPOModule (or PPOModule, FlowGRPOModule, AgenticGRPOModule: sampling, loss, "
    "clipping, KL, advantages, lr, lr_schedule, warmup_steps, mini_batches, micro-batches, LoRA), "
    "--trainer.strategy.help AsyncRolloutStrategy (engine, max_staleness, max_inflight, num_workers, "
    "placement, weight_sync, restarts, timeouts), --data.help unirl_lightning.data.PromptDataModule (train, val, batch_size "
    "in prompts per rank, max_prompt_length, map_fn), --trainer.callbacks.help "
    "unirl_lightning.callbacks.RolloutEvalCallback. "
    "Every step setting counts RL steps (max_steps, every_n_steps, every_n_train_steps, warmup_steps). "
    "--print_config shows a recipe's every value; unirl-lightning plan --config X.yaml checks it "
    "against a cluster."
)


class UniRLCLI(LightningCLI):
    """LightningCLI with RL modules and datamodules in subclass mode."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", RLArgumentParser)
        kwargs.setdefault("model_class", RLModule)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("datamodule_class", LightningDataModule)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        if kwargs.get("run", True):  # the verbs' parsers: fit --help ends with where the RL settings are
            given = kwargs.get("parser_kwargs") or {}
            kwargs["parser_kwargs"] = {"fit": {"epilog": FIT_SETTINGS_HELP}, **given}
        super().__init__(*args, **kwargs)

    missing_last_hint = FIT_MISSING_LAST  # what to do when ``--ckpt_path last`` finds no checkpoint

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """Lightning's parse, then the checkpoint's module settings over the config's, the same for
        ``--ckpt_path last`` (resolved here to its file), a file and a sharded checkpoint's folder: a
        resume continues the saved run (Lightning's rule for a file, which Lightning applies after
        this for ``fit``/``validate``; a folder's, and ``export``'s, are applied here). A setting the
        config gives otherwise is named in a warning."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        config = self.config.get(subcommand) if subcommand else self.config
        try:
            resolve_last_checkpoint(config, hint=self.missing_last_hint)
        except FileNotFoundError as exc:
            parser.error(str(exc))
        hparams = checkpoint_hyperparameters(config.get("ckpt_path"))
        for line in checkpoint_overrides(config, hparams):
            rank_zero_warn(line)
        lightning_applies = subcommand and not Path(config.get("ckpt_path") or "").is_dir()
        if hparams and not lightning_applies and isinstance(config.get("model"), Namespace):
            model = {"model": {"class_path": config["model"]["class_path"], "init_args": hparams}}
            self.config = parser.parse_object({subcommand: model} if subcommand else model, self.config)

    def before_instantiate_classes(self) -> None:
        subcommand = self.config.get("subcommand")
        config = self.config.get(subcommand) if subcommand else self.config
        try:
            check_combinations(config)
            check_reward_paths(config)
            refuse_cli_optimizers(config)
            refuse_trainer_flags(config)
            if subcommand == "fit":
                check_data_paths(config)
        except (ValueError, FileNotFoundError) as exc:
            self.parser.error(str(exc))  # exit code 2 with the message, before anything is built
        add_rl_progress_bar(config)
        drop_disabled_checkpoints(config)

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

    missing_last_hint = "give the checkpoint's path (a .ckpt file or a sharded checkpoint folder)"

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
    built, so a GPU recipe exports on a CPU machine), then :func:`unirl_lightning.models.export.export_checkpoint`.
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
        from unirl_lightning.models.export import check_checkpoint_path, check_output

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

        parser = LightningArgumentParser()
        parser.add_lightning_class_args(self.model_class, "model", subclass_mode=self.subclass_mode_model)
        config = parser.parse_object({"model": self.config["model"].as_dict()})
        self.model = parser.instantiate_classes(config)["model"]
        self.trainer = self.datamodule = None

    def export(self) -> Path:
        from unirl_lightning.models.export import export_checkpoint

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
    log = logging.getLogger("unirl_lightning.models.export")
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
        from unirl_lightning.models.export import check_checkpoint_path

        super().before_instantiate_classes()  # the fit checks, and 'last' resolved
        if self.config.get("ckpt_path"):
            try:
                check_checkpoint_path(self.config["ckpt_path"])
            except (ValueError, FileNotFoundError) as exc:
                self.parser.error(str(exc))

    def validate(self) -> dict[str, float] | None:
        """Evaluate once; the figures on rank 0 (None on the other ranks)."""
        from unirl_lightning.callbacks import RolloutEvalCallback
        from unirl_lightning.models.export import load_policy_checkpoint

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
    :func:`unirl_lightning.planning.plan.plan_recipe` against ``--cluster`` (default: the config's
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
            check_rollout_combinations(config)  # plan_recipe applies the other setup rules itself
            check_reward_paths(config)
        except ValueError as exc:
            self.plan_error = str(exc)  # a finding of the plan, reported with the rest
        else:
            self.plan_error = None

    def instantiate_classes(self) -> None:
        """Nothing is built."""
        self.model = self.trainer = self.datamodule = None

    def plan(self) -> dict[str, Any]:
        from unirl_lightning.planning.plan import ModelShape, parse_cluster, plan_recipe

        config = self.config
        files = [str(path) for path in config.get("config") or []]
        cluster_text = config.get("cluster") or header_cluster(files)
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
        data = plain_data(plain)
        folder = config.get("model_config") or bundled_model_config(data)
        if folder and not (Path(folder) / "config.json").is_file():
            self.parser.error(
                f"--model_config {folder}: no config.json there (a folder with the model's config.json and "
                "tokenizer_config.json; examples/model_configs/ has those of the models the examples name)"
            )
        shape = ModelShape.from_dir(folder) if folder else None
        result = plan_recipe(data, cluster, shape)
        if self.plan_error:
            result["ok"] = False
            result["findings"].insert(0, {"level": "error", "key": "config", "message": self.plan_error})
        result["cluster"] = cluster_text
        result["model_config"] = str(folder) if folder else None
        if config.get("output"):
            Path(config["output"]).write_text(json.dumps(result, indent=2) + "\n")
        return result


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
