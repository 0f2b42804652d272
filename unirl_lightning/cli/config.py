"""The fit config's checks and rewrites after parsing and before anything is built (no model, no Ray):
combinations that cannot run, reward import paths, data paths, LightningCLI's optimizer keys, the
``--ckpt_path last`` resolution, and the RL progress bar. Each raises ``ValueError`` /
``FileNotFoundError`` naming the key; the CLI turns that into exit code 2."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import logging
import os
import zipfile
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar

from unirl_lightning.core.device_rules import (
    checkpoint_names_error,
    recipe_device_errors,
    renamed_by_transformers,
)
from unirl_lightning.core.imports import import_callable
from unirl_lightning.core.preflight import (
    continue_engine_error,
    hybrid_engine_error,
    serving_engine,
    sync_replacement_error,
    weight_sync_placement_error,
)
from unirl_lightning.data.reasoning_gym import is_reasoning_gym, task_error
from unirl_lightning.planning.plan import FSDP_STRATEGY, world_size

log = logging.getLogger(__name__)


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
        for key in (
            "placement",
            "max_staleness",
            "max_inflight",
            "sync_mode",
            "weight_sync",
            "max_worker_restarts",
            "engine",
        )
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


FIT_MISSING_LAST = "omit --ckpt_path to start a new run, or give the checkpoint's path"


def resolve_last_checkpoint(config: Any, hint: str = FIT_MISSING_LAST) -> None:
    """``ckpt_path: last`` -> the newest ``last*.ckpt`` of this run, and the logger continues in that
    run's folder; ``FileNotFoundError`` naming where it looked, and ``hint``, when there is none."""
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
        raise FileNotFoundError(f"ckpt_path: 'last' was given but there is no last*.ckpt in {looked}; {hint}")
    path, version = max(found, key=lambda item: item[0].stat().st_mtime)
    config["ckpt_path"] = str(path)
    if version is not None and isinstance(logger, Namespace) and logger.init_args.get("version") is None:
        logger.init_args["version"] = version  # log and checkpoint on in the resumed run's folder


def checkpoint_hyperparameters(ckpt_path: str | None) -> dict[str, Any]:
    """The module settings a checkpoint was saved with (``hyper_parameters``, without Lightning's
    ``_class_path`` / ``_instantiator``): of a ``.ckpt`` file (memory-mapped: the weights are not
    read) or of a sharded checkpoint folder's metadata; ``{}`` for anything else."""
    import torch

    from unirl_lightning.models.export import SHARDED_METADATA

    path = Path(ckpt_path) if ckpt_path else None
    if path is not None and path.is_dir():
        path = path / SHARDED_METADATA
    if path is None or not path.is_file():
        return {}
    try:  # memory-mapped where the file allows it (torch's zip format: the weights are not read)
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception:  # not a checkpoint: the subcommand's own check names the path
        return {}
    hparams = dict(saved.get("hyper_parameters") or {}) if isinstance(saved, dict) else {}
    return {k: v for k, v in hparams.items() if k not in ("_class_path", "_instantiator")}


def checkpoint_overrides(config: Any, hparams: dict[str, Any]) -> list[str]:
    """One line per module setting whose value in the config (file or command line) differs from the
    checkpoint's ``hparams``: on resume the checkpoint's value is the one used."""
    model = config.get("model")
    given = model.get("init_args") if isinstance(model, Namespace) else None
    lines = []
    for key, saved in hparams.items():
        value = given.get(key) if isinstance(given, Namespace) and key in given else None
        if value is None or isinstance(value, Namespace):
            continue
        if (list(value) if isinstance(value, tuple) else value) != (
            list(saved) if isinstance(saved, tuple) else saved
        ):
            lines.append(
                f"model.init_args.{key}: the config says {value!r}, the checkpoint {saved!r}; resuming with "
                f"the checkpoint's {saved!r} (a resume continues the saved run; start a new run to change it)"
            )
    return lines


def check_rollout_combinations(config: Any) -> dict[str, Any] | None:
    """Reject rollout settings that parse but cannot run together (the strategy's own rule,
    :func:`check_rollout_settings`), naming the keys; the strategy's settings, or None when the trainer
    has no rollout strategy."""
    from unirl_lightning.runtime import check_rollout_settings

    trainer = config.get("trainer") if hasattr(config, "get") else None
    settings = _strategy_settings(trainer)
    if settings is None:
        return None
    try:
        keys = ("placement", "max_staleness", "max_inflight", "sync_mode")
        check_rollout_settings(**{k: settings[k] for k in keys})
    except ValueError as exc:
        raise ValueError(f"trainer.strategy.init_args: {exc}") from None
    weight_sync = settings["weight_sync"]
    kind = weight_sync if isinstance(weight_sync, str) else _backend_kind(weight_sync)
    error = weight_sync_placement_error(str(settings["placement"]), kind)
    if error is not None:
        raise ValueError(f"trainer.strategy.init_args: {error}")
    return settings


def _backend_kind(node: Any) -> str:
    """A weight-sync backend given by class path: its kind's name (``"other"`` for a user's own)."""
    class_path = node.get("class_path") if hasattr(node, "get") else None
    if not class_path:
        return "other"
    from unirl_lightning.weight_sync import weight_sync_kind

    cls = _import_class(class_path)
    return weight_sync_kind(cls.__new__(cls))


def check_combinations(config: Any) -> None:
    """Reject configurations that parse but cannot run, before anything is built; the message names
    the keys: :func:`check_rollout_combinations`,
    :func:`~unirl_lightning.core.preflight.sync_replacement_error` and
    :func:`~unirl_lightning.core.preflight.hybrid_engine_error` (``plan`` applies the last two itself)."""
    settings = check_rollout_combinations(config)
    if settings is None:
        return
    trainer = config.get("trainer")
    sharded = trainer.get("strategy").get("class_path") == FSDP_STRATEGY
    restarts = int(settings["max_worker_restarts"])
    error = sync_replacement_error(str(settings["weight_sync"]), sharded, world_size(trainer), restarts)
    if error is None:
        engine = settings["engine"]
        engine = str(engine.get("class_path") or "") if hasattr(engine, "get") else str(engine)
        error = hybrid_engine_error(str(settings["placement"]), engine, world_size(trainer))
    if error is not None:
        raise ValueError(f"trainer.strategy.init_args: {error}")
    for key, error in recipe_device_errors(config, _trainer_on_cuda(trainer)):
        raise ValueError(f"{key}: {error}")
    error = _checkpoint_names_error(config, settings["engine"])
    if error is not None:
        raise ValueError(f"trainer.strategy.init_args.engine: {error}")
    if settings["sync_mode"] == "continue":  # the engine as the strategy will build it
        given = trainer.get("strategy").get("init_args")
        engine = given.get("engine", settings["engine"]) if hasattr(given, "get") else settings["engine"]
        if hasattr(engine, "get") and engine.get("class_path"):
            engine = _import_class(engine["class_path"])(**dict(engine.get("init_args") or {}))
        error = continue_engine_error("continue", engine)
        if error is not None:
            raise ValueError(f"trainer.strategy.init_args: {error}")


def _checkpoint_names_error(config: Any, engine: Any) -> str | None:
    """:func:`~unirl_lightning.core.device_rules.checkpoint_names_error` for a pretrained policy whose config is
    on this machine (a folder, or the hub cache); others are checked when the engine is built."""
    serving = serving_engine(engine)
    policy = (
        config.get("model").get("init_args").get("policy") if hasattr(config.get("model"), "get") else None
    )
    path = (
        policy.get("init_args").get("name_or_path")
        if hasattr(policy, "get") and policy.get("init_args")
        else None
    )
    if serving not in ("vllm", "sglang") or not path:
        return None
    try:
        from transformers import AutoConfig

        model_type = str(AutoConfig.from_pretrained(str(path), local_files_only=True).model_type)
    except Exception:  # noqa: BLE001 - not on this machine (a hub id, a GGUF file): the engine checks it
        return None
    return checkpoint_names_error(model_type, renamed_by_transformers(model_type), serving)


def _trainer_on_cuda(trainer: Any) -> bool:
    """Whether the training ranks will run on CUDA: ``trainer.accelerator`` (``"auto"``: a visible GPU)."""
    accelerator = str(trainer.get("accelerator") or "auto")
    if accelerator == "cpu":
        return False
    import torch

    return accelerator in ("gpu", "cuda") or torch.cuda.is_available()


def check_data_paths(config: Any) -> None:
    """A ``train`` / ``val`` prompt source of the data module that is neither a built-in task, nor
    ``hf:<id>``, nor a reasoning-gym dataset (``reasoning_gym:<name>``, its name checked), nor an
    existing file or folder fails here, naming the key, before any run folder is
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
        if is_reasoning_gym(source):
            try:
                error = task_error(source, key=f"data.init_args.{key}")
            except ImportError as exc:
                error = str(exc)
            if error is not None:
                raise ValueError(error)
            continue
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"data.init_args.{key}: prompt source {source!r} is not an existing file or folder (looked at "
                f"{path.resolve()}), not 'hf:<id>' and not a built-in task ({', '.join(sorted(BUILTIN_TASKS))})"
            )
        if path.suffix.lower() in (".parquet", ".arrow") and path.is_file():
            bad_row = scan_table_prompts(path, str(args.get("prompt_key") or "prompt"))
            if bad_row is not None:
                raise ValueError(
                    f"data.init_args.{key}: {path}, row {bad_row[0]} (of the table, from 1): {bad_row[1]}"
                )
        if path.suffix.lower() == ".jsonl":
            rows, bad = scan_json_lines(path)
            if bad is not None:
                raise ValueError(f"data.init_args.{key}: {path}:{bad[0]} is not a JSON object: {bad[1]}")
            batch_size = args.get("batch_size")
            if key == "train" and isinstance(batch_size, int) and rows < batch_size:
                raise ValueError(
                    f"data.init_args.train: {path} has {rows} rows, fewer than data.init_args.batch_size={batch_size} "
                    "(one RL step takes batch_size prompts): lower batch_size or add rows"
                )
    check_eval_prompts(config, args)


def scan_json_lines(path: Path) -> tuple[int, tuple[int, str] | None]:
    """The rows of a JSON-lines file (non-blank lines), and its first line that is not one JSON object
    as ``(line number, why)`` (None when all are); a streaming pass that stops at that line."""
    rows = 0
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                return rows, (number, f"{exc.msg} at column {exc.colno}")
            if not isinstance(row, dict):
                return rows, (number, f"a JSON {type(row).__name__}, not an object of columns")
            rows += 1
    return rows, None


def scan_table_prompts(path: Path, prompt_key: str) -> tuple[int, str] | None:
    """The first row of a parquet or arrow file whose prompt column holds neither text nor chat
    messages, as ``(row number from 1, why)``; None when every row does. Reads that one column."""
    import pyarrow.feather as feather
    import pyarrow.parquet as parquet

    try:
        if path.suffix.lower() == ".parquet":
            if prompt_key not in parquet.read_schema(path).names:
                return None  # the data module names the missing column, with the columns there are
            table = parquet.read_table(path, columns=[prompt_key])
        else:
            try:
                table = feather.read_table(path)
            except Exception:  # an Arrow IPC stream (datasets' .arrow files) rather than a file
                import pyarrow as pa

                with pa.memory_map(str(path)) as source:
                    table = pa.ipc.open_stream(source).read_all()
    except Exception as exc:
        return 0, f"not readable as a table: {exc}"
    if prompt_key not in table.column_names:
        return None  # the data module names the missing column, with the columns there are
    for number, value in enumerate(table.column(prompt_key).to_pylist(), start=1):
        if not isinstance(value, (str, list)):
            return (
                number,
                f"its {prompt_key!r} holds {type(value).__name__} {value!r:.80}, not text or chat messages",
            )
    return None


def check_eval_prompts(config: Any, data_args: Namespace) -> None:
    """A ``RolloutEvalCallback`` without prompts of its own evaluates the data module's held-out prompts;
    a dataset ``train`` (a file, a folder, ``hf:``) has none unless ``val`` or ``val_split`` is given."""
    from unirl_lightning.data.tasks import BUILTIN_TASKS

    train = data_args.get("train")
    if (
        not isinstance(train, str)
        or train in BUILTIN_TASKS
        or is_reasoning_gym(train)
        or data_args.get("val")
        or data_args.get("val_split")
    ):
        return
    trainer = config.get("trainer")
    callbacks = (trainer.get("callbacks") if hasattr(trainer, "get") else None) or []
    for index, callback in enumerate(callbacks):
        class_path = str(callback.get("class_path") or "") if hasattr(callback, "get") else ""
        args = callback.get("init_args") if hasattr(callback, "get") else None
        if class_path.endswith("RolloutEvalCallback") and not (args is not None and args.get("prompts")):
            raise ValueError(
                f"trainer.callbacks.{index} (RolloutEvalCallback) evaluates held-out prompts, but data.init_args.train="
                f"{train!r} is a dataset with none: set data.init_args.val (a file or 'hf:<id>') or "
                "data.init_args.val_split (e.g. 'test'), give the callback prompts=<file or task>, or remove it"
            )


def drop_disabled_checkpoints(config: Any) -> None:
    """``trainer.enable_checkpointing: false`` on a recipe that lists a ``ModelCheckpoint`` (or a subclass):
    leave the checkpoint callbacks out (one warning naming them) instead of Lightning's refusal of the pair."""
    trainer = config.get("trainer") if hasattr(config, "get") else None
    if trainer is None or trainer.get("enable_checkpointing") is not False:
        return
    callbacks = list(trainer.get("callbacks") or [])
    dropped = [
        index
        for index, callback in enumerate(callbacks)
        if hasattr(callback, "get")
        and callback.get("class_path")
        and issubclass(_import_class(callback.get("class_path")), ModelCheckpoint)
    ]
    if dropped:
        log.warning(
            "trainer.enable_checkpointing=false: the recipe's ModelCheckpoint (trainer.callbacks.%s) is left out",
            ", ".join(map(str, dropped)),
        )
        trainer["callbacks"] = [c for index, c in enumerate(callbacks) if index not in dropped]


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
