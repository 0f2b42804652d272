"""Prompt sources: built-in tasks and datasets read with ``datasets``, normalised to prompt records.

A *prompt record* is a plain dict ``{"prompt": str, "answer": ..., **other_keys}``; a chat record also
has ``"messages"``. :func:`load_prompt_dataset` reads a ``.jsonl``/``.json``/``.csv``/``.parquet``/
``.arrow`` file, a ``save_to_disk`` folder or ``"hf:<id>"`` (or builds a built-in task's records),
and :class:`PromptRecords` is the memory-mapped view that normalises rows as they are drawn.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from unirl_lightning.data.tasks import BUILTIN_TASKS, Partition, make_task

__all__ = [
    "DATASET_BUILDERS",
    "HUB_PREFIX",
    "SUPPORTED_SUFFIXES",
    "PromptRecords",
    "load_dataset_source",
    "load_prompt_dataset",
    "load_records",
]


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
    partition: Partition | None = None,
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
    from unirl_lightning.core.imports import import_callable

    mapper = import_callable(map_fn, "map_fn") if isinstance(map_fn, str) else map_fn
    keep = import_callable(filter_fn, "filter_fn") if isinstance(filter_fn, str) else filter_fn
    name = os.fspath(source)
    if name in BUILTIN_TASKS:
        if num_prompts is None:
            raise ValueError(f"Built-in task {name!r} needs num_prompts (an int >= 1); got None.")
        rows: Any = make_task(name, num_prompts, seed, partition=partition, **(task_kwargs or {}))
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
    partition: Partition | None = None,
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
        partition: For a built-in task, draw only ``"train"`` or only ``"held_out"`` prompts (see
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
        source, num_prompts, seed, prompt_key, answer_key, task_kwargs, partition, **dataset_kwargs
    )
    return list(records)
