"""Prompt records and the :class:`PromptDataModule` that serves them in batches.

Contract: a *prompt record* is a plain dict ``{"prompt": str, "answer": ..., **other_keys}``;
a chat record also has ``"messages"`` (``[{"role": str, "content": str}, ...]``), which
:func:`unirl_lightning.prompts.render_prompt` renders instead of ``"prompt"``.
:func:`load_records` reads records with the ``datasets`` library (a ``.jsonl``/``.json``/``.csv``/
``.parquet``/``.arrow`` file, a ``save_to_disk`` folder, or ``"hf:<id>"``), or builds them from a
built-in task (:mod:`unirl_lightning.data.tasks`), and normalises them: the prompt (and answer)
are copied from ``prompt_key`` (and ``answer_key``) to ``"prompt"`` (and ``"answer"``); a prompt
field holding a list of messages is copied to ``"messages"``, and ``"prompt"`` becomes its last
user turn (for logs). Every other key is kept as is, so rewards can read extra fields. :class:`PromptDataModule` yields
training batches as ``list[dict]`` (no tensor collation: the rollout side tokenizes), and
exposes the held-out records through :meth:`PromptDataModule.val_records` for the eval callback.
A dataset's records are a :class:`PromptRecords` over the memory-mapped Arrow table, normalised
row by row as batches are drawn.

Errors are raised when the data is loaded (``setup`` or the first ``*_records()`` call), and
configuration errors (``batch_size``, ``task_kwargs``) already in ``__init__``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from unirl_lightning.data.tasks import BUILTIN_TASKS, Split, make_task

log = logging.getLogger(__name__)

__all__ = [
    "DATASET_BUILDERS",
    "HeldOut",
    "PassSampler",
    "PromptDataModule",
    "PromptRecords",
    "SUPPORTED_SUFFIXES",
    "VAL_SEED_OFFSET",
    "collate_records",
    "load_dataset_source",
    "load_prompt_dataset",
    "load_records",
]

VAL_SEED_OFFSET = 1_000_003
"""Held-out records of a built-in task use ``seed + VAL_SEED_OFFSET``."""

HeldOut = Literal["disjoint", "resample"]
"""How :class:`PromptDataModule` draws held-out records of a built-in task (see its docstring)."""


def collate_records(batch: list[dict]) -> list[dict]:
    """``collate_fn`` that keeps a batch as the list of record dicts (module level: picklable)."""
    return list(batch)


class PassSampler(Sampler[int]):
    """Indices ``0..size-1`` in the order of pass ``epoch`` (a one-rank :class:`DistributedSampler`).

    Shuffled, pass ``e`` is ``torch.randperm(size)`` drawn from a generator seeded with ``seed + e``:
    exactly the order of ``DistributedSampler(num_replicas=1, rank=0, shuffle=True, seed=seed)`` after
    ``set_epoch(e)``, so one rank and several follow one rule. The order is a function of ``(seed, e)``
    only, so a resumed prompt stream that asks for its pass (``set_epoch``) gets that pass's order
    again. A pass iterated to its end moves on to the next one, so a plain loop over the loader (no
    ``set_epoch``) still reshuffles every time. Unshuffled, every pass is ``0..size-1``.
    """

    def __init__(self, size: int, shuffle: bool, seed: int) -> None:
        self.size = size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> list[int]:
        """The indices of pass ``epoch``."""
        if not self.shuffle:
            return list(range(self.size))
        generator = torch.Generator().manual_seed(self.seed + epoch)  # DistributedSampler's rule
        return torch.randperm(self.size, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        epoch = self.epoch
        yield from self.order(epoch)
        if self.epoch == epoch:  # a full pass, not re-positioned meanwhile: the next pass is next
            self.epoch = epoch + 1

    def __len__(self) -> int:
        return self.size


def train_loader(
    records: Any, batch_size: int, shuffle: bool, seed: int, world_size: int = 1, rank: int = 0
) -> DataLoader:
    """Full batches of records (the last partial batch is dropped), shuffled repeatably: pass ``e``'s
    order is a function of ``(seed, e)`` (the sampler's ``set_epoch(e)``), on one rank
    (:class:`PassSampler`) as on several (a ``DistributedSampler``, which Lightning then keeps, gives
    each rank its disjoint share of the pass)."""
    if world_size > 1:
        sampler = DistributedSampler(
            records, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=True
        )
        return DataLoader(
            records, batch_size=batch_size, sampler=sampler, drop_last=True, collate_fn=collate_records
        )
    return DataLoader(
        records,
        batch_size=batch_size,
        sampler=PassSampler(len(records), shuffle, seed),
        drop_last=True,
        collate_fn=collate_records,
        generator=torch.Generator().manual_seed(seed),  # the iterator's base seed: not the global RNG
    )


def _normalise(raw: Any, prompt_key: str, answer_key: str | None, where: str) -> dict:
    if not isinstance(raw, dict):
        raise ValueError(
            f"{where}: expected a JSON object (dict) record, got {type(raw).__name__}: {raw!r:.200}."
        )
    if prompt_key not in raw:
        raise ValueError(
            f"{where}: record has no prompt key {prompt_key!r} (keys: {sorted(raw)}); "
            "set prompt_key to the field holding the prompt."
        )
    prompt = raw[prompt_key]
    record = dict(raw)
    if isinstance(prompt, list):
        record["messages"] = _check_messages(prompt, prompt_key, where)
        prompt = next((m["content"] for m in reversed(prompt) if m["role"] == "user"), None)
        if prompt is None:
            raise ValueError(
                f"{where}: chat messages under {prompt_key!r} have no 'user' turn; expected one."
            )
    elif not isinstance(prompt, str):
        raise ValueError(
            f"{where}: prompt key {prompt_key!r} holds {type(prompt).__name__} {prompt!r:.200}; "
            "expected a str or a list of {'role', 'content'} messages."
        )
    record["prompt"] = prompt
    if answer_key is not None:
        if answer_key not in raw:
            raise ValueError(
                f"{where}: record has no answer key {answer_key!r} (keys: {sorted(raw)}); "
                "set answer_key to the field holding the answer, or answer_key=None for prompts without one."
            )
        record["answer"] = raw[answer_key]
    return record


def _check_messages(messages: list, prompt_key: str, where: str) -> list[dict]:
    for index, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f"{where}: message {index} under {prompt_key!r} is {message!r:.200}; "
                "expected {'role': str, 'content': str}."
            )
    return messages


DATASET_BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".tsv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".txt": "text",
}
"""File suffix -> the ``datasets`` builder that reads it (``datasets.load_dataset(builder, data_files=...)``)."""

SUPPORTED_SUFFIXES = tuple(DATASET_BUILDERS)

HUB_PREFIX = "hf:"
"""``train: "hf:<id>"`` loads ``<id>`` with ``datasets.load_dataset`` (needs hub access)."""


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as err:  # pragma: no cover - a declared dependency
        raise ImportError(
            "Reading prompt datasets needs the 'datasets' package: pip install datasets."
        ) from err
    return datasets


def load_dataset_source(
    source: str | os.PathLike,
    split: str | None = None,
    subset: str | None = None,
    data_files: Any = None,
) -> Any:
    """Open ``source`` as a ``datasets.Dataset`` (memory-mapped Arrow; nothing is read into lists).

    ``source`` is one of:

    * a local file of a format ``datasets`` reads (:data:`DATASET_BUILDERS`: ``.jsonl``/``.json``,
      ``.csv``/``.tsv``, ``.parquet``, ``.arrow``, ``.txt``);
    * a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` (then ``split``
      picks the split, default ``"train"``);
    * ``"hf:<id>"``: ``datasets.load_dataset(<id>, name=subset, split=split or "train",
      data_files=data_files)`` (downloads from the hub, or uses its cache).

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: an unsupported suffix, a missing split, or a file ``datasets`` cannot read.
    """
    datasets = _import_datasets()
    name = os.fspath(source)
    if name.startswith(HUB_PREFIX):
        dataset_id = name[len(HUB_PREFIX) :]
        if not dataset_id:
            raise ValueError(f"Prompt source {name!r} names no dataset; expected 'hf:<owner>/<name>'.")
        result = datasets.load_dataset(dataset_id, name=subset, split=split or "train", data_files=data_files)
        return _pick_split(result, split, name)
    path = Path(name).expanduser()
    if path.is_dir():
        try:
            result = datasets.load_from_disk(str(path))
        except FileNotFoundError as err:
            raise ValueError(
                f"Prompt folder {name!r} is not a folder written by Dataset.save_to_disk or "
                f"DatasetDict.save_to_disk: {err}"
            ) from err
        return _pick_split(result, split, name)
    if not path.is_file():
        raise FileNotFoundError(
            f"Prompt source {name!r} is not an existing file or folder (looked at {path.resolve()}), "
            f"not 'hf:<id>' and not a built-in task; built-in tasks: {sorted(BUILTIN_TASKS)}."
        )
    builder = DATASET_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(
            f"Prompt file {name!r} has suffix {path.suffix!r}; supported: {list(SUPPORTED_SUFFIXES)} "
            "(or a save_to_disk folder, or 'hf:<id>')."
        )
    kwargs = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
    except Exception as err:  # datasets raises its own types (DatasetGenerationError, ArrowInvalid, ...)
        if "no data" in str(err).lower() or "empty" in str(err).lower():
            raise ValueError(f"Prompt file {name!r} contains no records; expected at least one.") from err
        cause = err.__cause__ or err
        raise ValueError(
            f"Prompt file {name!r} could not be read as {builder}: {type(cause).__name__}: {cause}"
        ) from err


def _pick_split(result: Any, split: str | None, name: str) -> Any:
    datasets = _import_datasets()
    if isinstance(result, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        wanted = split or "train"
        if wanted not in result:
            raise ValueError(f"Prompt source {name!r} has no split {wanted!r}; its splits: {sorted(result)}.")
        result = result[wanted]
    if not isinstance(result, datasets.Dataset):
        raise ValueError(
            f"Prompt source {name!r} gave a {type(result).__name__}; expected a datasets.Dataset (not streaming)."
        )
    return result


class PromptRecords(torch.utils.data.Dataset):
    """The prompt records of a ``datasets.Dataset``, normalised row by row when indexed.

    Sized and indexable (what the samplers and the ``DataLoader`` need): ``records[i]`` is the
    normalised record dict of row ``i`` (every column, plus ``"prompt"``/``"answer"``, see
    :func:`load_records`), ``records[i:j]`` a list of them, and a batch of indices is read from the
    Arrow table at once (``__getitems__``), so a large dataset stays memory-mapped and only the rows
    of each batch become dicts. A list of records (a built-in task) is served the same way.
    """

    def __init__(
        self,
        rows: Any,
        prompt_key: str = "prompt",
        answer_key: str | None = "answer",
        source: str = "<records>",
    ) -> None:
        self.rows = rows
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.source = source

    def __len__(self) -> int:
        return len(self.rows)

    def _record(self, raw: Any, index: int) -> dict:
        return _normalise(raw, self.prompt_key, self.answer_key, f"{self.source}, row {index + 1}")

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return self.__getitems__(list(range(len(self)))[index])
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} of {len(self)}")
        return self._record(self.rows[index], index)

    def __getitems__(self, indices: list[int]) -> list[dict]:
        if isinstance(self.rows, list) or not indices:
            return [self[i] for i in indices]
        columns = self.rows[list(indices)]  # one Arrow read: {column: [values]}
        names = list(columns)
        return [
            self._record({name: columns[name][k] for name in names}, index) for k, index in enumerate(indices)
        ]

    def __iter__(self) -> Iterator[dict]:
        for start in range(0, len(self), 256):
            yield from self.__getitems__(list(range(start, min(start + 256, len(self)))))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, PromptRecords)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PromptRecords({self.source!r}, {len(self)} rows)"


def load_prompt_dataset(
    source: str | os.PathLike,
    num_prompts: int | None = None,
    seed: int = 0,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    task_kwargs: dict | None = None,
    split: Split | None = None,
    dataset_split: str | None = None,
    subset: str | None = None,
    data_files: Any = None,
    filter_fn: str | Callable | None = None,
    map_fn: str | Callable | None = None,
) -> PromptRecords:
    """:func:`load_records` as a sized, indexable :class:`PromptRecords` (memory-mapped for files).

    ``dataset_split``, ``subset`` and ``data_files`` select within a ``DatasetDict`` folder or a hub
    dataset (see :func:`load_dataset_source`). ``map_fn`` (``row -> row``, or an import path
    ``"pkg.mod:fn"``) then ``filter_fn`` (``row -> bool``) run on the raw rows, before the prompt and
    answer keys are read: through ``datasets.Dataset.map`` / ``filter`` (cached, Arrow) for a
    dataset, in Python for a built-in task.
    """
    from unirl_lightning.rewards.base import import_callable

    mapper = import_callable(map_fn) if isinstance(map_fn, str) else map_fn
    keep = import_callable(filter_fn) if isinstance(filter_fn, str) else filter_fn
    name = os.fspath(source)
    if name in BUILTIN_TASKS:
        if num_prompts is None:
            raise ValueError(f"Built-in task {name!r} needs num_prompts (an int >= 1); got None.")
        rows: Any = make_task(name, num_prompts, seed, split=split, **(task_kwargs or {}))
        if mapper is not None:
            rows = [mapper(dict(row)) for row in rows]
        if keep is not None:
            rows = [row for row in rows if keep(row)]
        return PromptRecords(rows, "prompt", "answer", name)
    dataset = load_dataset_source(name, dataset_split, subset, data_files)
    if mapper is not None:
        dataset = dataset.map(mapper)
    if keep is not None:
        dataset = dataset.filter(keep)
    if len(dataset) == 0:
        raise ValueError(f"Prompt file {name!r} contains no records; expected at least one.")
    columns = list(dataset.column_names)
    if prompt_key not in columns:
        raise ValueError(
            f"{name}: the dataset has no prompt column {prompt_key!r} (columns: {sorted(columns)}); "
            "set prompt_key to the column holding the prompt."
        )
    if answer_key is not None and answer_key not in columns:
        raise ValueError(
            f"{name}: the dataset has no answer column {answer_key!r} (columns: {sorted(columns)}); "
            "set answer_key to the column holding the answer, or answer_key=None for prompts without one."
        )
    records = PromptRecords(dataset, prompt_key, answer_key, name)
    records[0]  # fail at load, naming the row, when the first record is malformed
    return records


def load_records(
    source: str | os.PathLike,
    num_prompts: int | None = None,
    seed: int = 0,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    task_kwargs: dict | None = None,
    split: Split | None = None,
    **dataset_kwargs: Any,
) -> list[dict]:
    """Load prompt records (a list of dicts) from a built-in task name or a dataset.

    A dataset is anything :func:`load_dataset_source` opens: a file ``datasets`` reads
    (``.jsonl``, ``.json``, ``.csv``, ``.parquet``, ``.arrow``, ...), a ``save_to_disk`` folder, or
    ``"hf:<id>"``. Every record keeps all its columns; ``prompt_key`` (and ``answer_key``) are
    copied to ``"prompt"`` (and ``"answer"``); a prompt column holding chat messages is copied to
    ``"messages"`` and ``"prompt"`` becomes its last user turn. :class:`PromptDataModule` uses
    :func:`load_prompt_dataset` instead, which keeps the rows memory-mapped.

    Args:
        source: A name in :data:`~unirl_lightning.data.tasks.BUILTIN_TASKS`, a file or folder path,
            or ``"hf:<id>"``.
        num_prompts: Number of records for a built-in task (required for one); ignored for datasets.
        seed: Seed of a built-in task.
        prompt_key: Column holding the prompt (copied to ``"prompt"``).
        answer_key: Column holding the answer (copied to ``"answer"``); ``None`` to allow
            records without an answer.
        task_kwargs: Extra keyword arguments of a built-in task.
        split: For a built-in task, draw only ``"train"`` or only ``"held_out"`` prompts (see
            :func:`~unirl_lightning.data.tasks.make_task`); ignored for datasets.
        dataset_kwargs: ``dataset_split``, ``subset``, ``data_files``, ``filter_fn``, ``map_fn`` of
            :func:`load_prompt_dataset`.

    Raises:
        FileNotFoundError: ``source`` is neither a built-in task nor an existing file or folder.
        ValueError: unsupported suffix, unreadable file, a dataset without the prompt/answer
            column, a malformed record (the message names the row and the source), or no records.

    Example::

        >>> load_records("add_mod10", num_prompts=1, seed=0)
        [{'prompt': '6+6=', 'answer': '2', 'task': 'add_mod10'}]
    """
    records = load_prompt_dataset(
        source, num_prompts, seed, prompt_key, answer_key, task_kwargs, split, **dataset_kwargs
    )
    return list(records)


def _check_positive_int(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"PromptDataModule {key}={value!r} is invalid; expected an int >= 1.")


class PromptDataModule(LightningDataModule):
    """Serve prompt records: training batches of ``batch_size`` records, plus held-out records.

    ``train_dataloader()`` yields ``list[dict]`` batches of exactly ``batch_size`` records
    (the last partial batch of an epoch is dropped so every RL step sees the same number of
    prompts; Lightning's ``max_steps`` ends training and epochs restart as needed). With several
    training ranks each rank gets its own disjoint share (a ``DistributedSampler`` that keeps
    ``shuffle`` and ``seed``). :meth:`val_records` returns the held-out records, in a fixed order,
    for ``RolloutEvalCallback`` (there is no ``val_dataloader``: RL modules have no validation
    step; held-out evaluation runs on the rollout workers).

    For a built-in task, training records use ``seed`` and held-out records
    ``seed + VAL_SEED_OFFSET``, and ``held_out`` says how the two relate:

    * ``"disjoint"``: the task's prompt space is partitioned by a hash of the prompt
      (:func:`~unirl_lightning.data.tasks.is_held_out`, 10% held out): training records come from
      one side, held-out records from the other, so no held-out prompt is ever trained on, for any
      seed and size. Use it to measure generalisation (``word_problems``, or the digit tasks with a
      large prompt space such as ``digit_successor`` with ``prefix_len``). A task whose prompt
      space is too small to split fails at ``setup`` with a message saying so.
    * ``"resample"`` (default): both come from the whole prompt space, drawn with the two seeds,
      so held-out prompts may also appear in training. With the 10 prompts of
      ``digit_successor`` that is the only choice: the CPU demo's "held-out" accuracy then tracks
      the training prompts, not generalisation.

    A ``val`` dataset is used as given, whatever ``held_out`` says. With a dataset ``train`` and no
    ``val`` (nor ``val_split``), there are no held-out records (``val_records() == []``).

    Datasets are read with the ``datasets`` library and stay memory-mapped: the records are a
    sized, indexable :class:`PromptRecords` over the Arrow table, and each batch's rows become
    dicts only when the batch is drawn. Every column reaches the reward (records are dicts of all
    columns, plus ``"prompt"`` and ``"answer"``).

    Args:
        train: A built-in task name (``digit_successor``, ``copy_first``, ``add_mod10``,
            ``word_problems``); a local file ``datasets`` reads (``.jsonl``, ``.json``, ``.csv``,
            ``.tsv``, ``.parquet``, ``.arrow``, ``.txt``); a folder written by
            ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``; or ``"hf:<id>"`` (a hub
            dataset, loaded with ``datasets.load_dataset``: needs hub access or its cache).
        val: Same for held-out records; ``None`` means the same built-in task with another seed,
            the ``train`` dataset's ``val_split`` when given, or nothing.
        batch_size: Prompts per training step (per rank).
        num_train_prompts: Records generated for a built-in ``train`` task.
        num_val_prompts: Records generated for a built-in held-out task.
        prompt_key: File field holding the prompt; records are normalised to ``"prompt"``.
        answer_key: File field holding the answer; normalised to ``"answer"``. ``None`` allows
            records without an answer (e.g. for a reward model).
        seed: Seed of built-in tasks and of the training shuffle order.
        shuffle: Shuffle training records each pass (the order of pass ``e`` is a function of
            ``(seed, e)``, see :class:`PassSampler`, so a resume in any pass continues it exactly).
        task_kwargs: Extra arguments of the built-in task(s), e.g. ``{"prefix_len": 2}``; with
            datasets only they are ignored, with one warning naming them.
        held_out: ``"disjoint"`` or ``"resample"``: how built-in held-out records relate to the
            training records (above).
        split: The split of a ``DatasetDict`` folder or hub dataset to train on (default ``"train"``).
        val_split: The split of the same source (or of ``val``) to hold out, e.g. ``"test"``.
        subset: A hub dataset's configuration (``load_dataset(<id>, name=subset)``).
        data_files: ``load_dataset``'s ``data_files`` for a hub dataset (a path, list or dict).
        map_fn: ``row -> row`` (or its import path ``"pkg.mod:fn"``), applied to the raw rows of
            train and val (``Dataset.map``) before ``prompt_key``/``answer_key`` are read.
        filter_fn: ``row -> bool`` (or its import path), keeps the rows it is true for, after ``map_fn``.

    Example::

        # YAML (LightningCLI):
        # data:
        #   class_path: unirl_lightning.data.PromptDataModule
        #   init_args: {train: add_mod10, batch_size: 8, num_train_prompts: 1024}
        # or, with held-out problems never trained on:
        #   init_args: {train: word_problems, batch_size: 8, held_out: disjoint}
        >>> data = PromptDataModule("add_mod10", batch_size=2, num_train_prompts=4, shuffle=False)
        >>> data.setup("fit")
        >>> next(iter(data.train_dataloader()))
        [{'prompt': '6+6=', 'answer': '2', 'task': 'add_mod10'}, {'prompt': '0+4=', 'answer': '4', 'task': 'add_mod10'}]
    """

    def __init__(
        self,
        train: str,
        val: str | None = None,
        batch_size: int = 8,
        num_train_prompts: int = 1024,
        num_val_prompts: int = 64,
        prompt_key: str = "prompt",
        answer_key: str | None = "answer",
        seed: int = 0,
        shuffle: bool = True,
        task_kwargs: dict | None = None,
        held_out: HeldOut = "resample",
        split: str | None = None,
        val_split: str | None = None,
        subset: str | None = None,
        data_files: str | list[str] | dict[str, str | list[str]] | None = None,
        map_fn: str | None = None,
        filter_fn: str | None = None,
    ) -> None:
        super().__init__()
        if held_out not in get_args(HeldOut):
            raise ValueError(
                f"PromptDataModule held_out={held_out!r} is invalid; expected one of {list(get_args(HeldOut))}."
            )
        _check_positive_int("batch_size", batch_size)
        _check_positive_int("num_train_prompts", num_train_prompts)
        _check_positive_int("num_val_prompts", num_val_prompts)
        uses_task = train in BUILTIN_TASKS or val in BUILTIN_TASKS
        if task_kwargs and not uses_task:
            log.warning(
                "PromptDataModule: task_kwargs %s are ignored: they only apply to built-in tasks, and train=%r "
                "and val=%r are datasets.",
                sorted(task_kwargs),
                train,
                val,
            )
            task_kwargs = None
        self.save_hyperparameters()
        self.train_source = train
        self.val_source = val
        self.batch_size = batch_size
        self.num_train_prompts = num_train_prompts
        self.num_val_prompts = num_val_prompts
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.seed = seed
        self.shuffle = shuffle
        self.task_kwargs = dict(task_kwargs or {})
        self.held_out = held_out
        self.split = split
        self.val_split = val_split
        self.subset = subset
        self.data_files = data_files
        self.map_fn = map_fn
        self.filter_fn = filter_fn
        self._train_records: list[dict] | PromptRecords | None = None
        self._val_records: list[dict] | PromptRecords | None = None

    def _load(
        self, source: str, num_prompts: int, seed: int, split: Split, dataset_split: str | None
    ) -> list[dict] | PromptRecords:
        if source in BUILTIN_TASKS:  # small and generated: a plain list
            split_or_none = split if self.held_out == "disjoint" else None
            return list(
                load_prompt_dataset(
                    source,
                    num_prompts,
                    seed,
                    task_kwargs=self.task_kwargs,
                    split=split_or_none,
                    map_fn=self.map_fn,
                    filter_fn=self.filter_fn,
                )
            )
        return load_prompt_dataset(
            source,
            prompt_key=self.prompt_key,
            answer_key=self.answer_key,
            dataset_split=dataset_split,
            subset=self.subset,
            data_files=self.data_files,
            map_fn=self.map_fn,
            filter_fn=self.filter_fn,
        )

    def setup(self, stage: str | None = None) -> None:
        """Load train and held-out records (idempotent; datasets stay memory-mapped)."""
        if self._train_records is None:
            records = self._load(self.train_source, self.num_train_prompts, self.seed, "train", self.split)
            if len(records) < self.batch_size:
                raise ValueError(
                    f"PromptDataModule train={self.train_source!r} has {len(records)} records, fewer than "
                    f"batch_size={self.batch_size}; expected at least batch_size records."
                )
            self._train_records = records
        if self._val_records is None:
            val_source = self.val_source
            if val_source is None:
                builtin = self.train_source in BUILTIN_TASKS
                val_source = self.train_source if builtin or self.val_split is not None else None
            self._val_records = (
                []
                if val_source is None
                else self._load(
                    val_source, self.num_val_prompts, self.seed + VAL_SEED_OFFSET, "held_out", self.val_split
                )
            )

    def train_records(self) -> list[dict] | PromptRecords:
        """All training records (loads them on first call): sized and indexable."""
        self.setup()
        return self._train_records  # type: ignore[return-value]

    def val_records(self) -> list[dict] | PromptRecords:
        """All held-out records, in a fixed order (loads them on first call): sized and indexable."""
        self.setup()
        return self._val_records  # type: ignore[return-value]

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        world = trainer.world_size if trainer is not None else 1
        rank = trainer.global_rank if trainer is not None else 0
        return train_loader(self.train_records(), self.batch_size, self.shuffle, self.seed, world, rank)
