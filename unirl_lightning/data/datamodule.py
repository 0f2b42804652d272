"""Prompt records and the :class:`PromptDataModule` that serves them in batches.

Contract: a *prompt record* is a plain dict ``{"prompt": str, "answer": ..., **other_keys}``;
a chat record also has ``"messages"`` (``[{"role": str, "content": str}, ...]``), which
:func:`unirl_lightning.prompts.render_prompt` renders instead of ``"prompt"``.
:func:`load_records` reads records from a ``.jsonl`` or ``.parquet`` file, or builds them from a
built-in task (:mod:`unirl_lightning.data.tasks`), and normalises them: the prompt (and answer)
are copied from ``prompt_key`` (and ``answer_key``) to ``"prompt"`` (and ``"answer"``); a prompt
field holding a list of messages is copied to ``"messages"``, and ``"prompt"`` becomes its last
user turn (for logs). Every other key is kept as is, so rewards can read extra fields. :class:`PromptDataModule` yields
training batches as ``list[dict]`` (no tensor collation: the rollout side tokenizes), and
exposes the held-out records through :meth:`PromptDataModule.val_records` for the eval callback.

Errors are raised when the data is loaded (``setup`` or the first ``*_records()`` call), and
configuration errors (``batch_size``, ``task_kwargs``) already in ``__init__``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, DistributedSampler

from unirl_lightning.data.tasks import BUILTIN_TASKS, Split, make_task

__all__ = [
    "HeldOut",
    "PromptDataModule",
    "SUPPORTED_SUFFIXES",
    "VAL_SEED_OFFSET",
    "collate_records",
    "load_records",
]

VAL_SEED_OFFSET = 1_000_003
"""Held-out records of a built-in task use ``seed + VAL_SEED_OFFSET``."""

HeldOut = Literal["disjoint", "resample"]
"""How :class:`PromptDataModule` draws held-out records of a built-in task (see its docstring)."""

SUPPORTED_SUFFIXES = (".jsonl", ".parquet")


def collate_records(batch: list[dict]) -> list[dict]:
    """``collate_fn`` that keeps a batch as the list of record dicts (module level: picklable)."""
    return list(batch)


def train_loader(
    records: list[dict], batch_size: int, shuffle: bool, seed: int, world_size: int = 1, rank: int = 0
) -> DataLoader:
    """Full batches of records (the last partial batch is dropped), shuffled repeatably from ``seed``;
    with ``world_size > 1`` this rank's disjoint share of them (Lightning then keeps the sampler)."""
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
        shuffle=shuffle,
        drop_last=True,
        collate_fn=collate_records,
        generator=torch.Generator().manual_seed(seed),
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


def _read_jsonl(path: Path, prompt_key: str, answer_key: str | None) -> list[dict]:
    records = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {line_number}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: invalid JSON ({err.msg} at column {err.colno}).") from err
            records.append(_normalise(raw, prompt_key, answer_key, where))
    return records


def _read_parquet(path: Path, prompt_key: str, answer_key: str | None) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(f"Reading {path} needs the 'pyarrow' package: pip install pyarrow.") from err
    rows = pq.read_table(path).to_pylist()
    # Parquet has no lines: report the 1-based row number as the "line".
    return [
        _normalise(raw, prompt_key, answer_key, f"{path}, line {row + 1}") for row, raw in enumerate(rows)
    ]


def load_records(
    source: str | os.PathLike,
    num_prompts: int | None = None,
    seed: int = 0,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    task_kwargs: dict | None = None,
    split: Split | None = None,
) -> list[dict]:
    """Load prompt records from a built-in task name, a ``.jsonl`` file or a ``.parquet`` file.

    Args:
        source: A name in :data:`~unirl_lightning.data.tasks.BUILTIN_TASKS` or a file path.
        num_prompts: Number of records for a built-in task (required for one); ignored for files.
        seed: Seed of a built-in task.
        prompt_key: File field holding the prompt (copied to ``"prompt"``).
        answer_key: File field holding the answer (copied to ``"answer"``); ``None`` to allow
            records without an answer.
        task_kwargs: Extra keyword arguments of a built-in task.
        split: For a built-in task, draw only ``"train"`` or only ``"held_out"`` prompts (see
            :func:`~unirl_lightning.data.tasks.make_task`); ignored for files.

    Raises:
        FileNotFoundError: ``source`` is neither a built-in task nor an existing file.
        ValueError: unsupported suffix, invalid JSON, a record without the prompt/answer key
            (the message names the key, the line and the file), or a file with no records.

    Example::

        >>> load_records("add_mod10", num_prompts=1, seed=0)
        [{'prompt': '6+6=', 'answer': '2', 'task': 'add_mod10'}]
    """
    name = os.fspath(source)
    if name in BUILTIN_TASKS:
        if num_prompts is None:
            raise ValueError(f"Built-in task {name!r} needs num_prompts (an int >= 1); got None.")
        return make_task(name, num_prompts, seed, split=split, **(task_kwargs or {}))
    path = Path(name).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"Prompt source {name!r} is not an existing file (looked at {path.resolve()}) "
            f"and not a built-in task; built-in tasks: {sorted(BUILTIN_TASKS)}."
        )
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        records = _read_jsonl(path, prompt_key, answer_key)
    elif suffix == ".parquet":
        records = _read_parquet(path, prompt_key, answer_key)
    else:
        raise ValueError(
            f"Prompt file {name!r} has suffix {path.suffix!r}; supported: {list(SUPPORTED_SUFFIXES)}."
        )
    if not records:
        raise ValueError(f"Prompt file {name!r} contains no records; expected at least one.")
    return records


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

    A ``val`` file is used as given, whatever ``held_out`` says. With a file ``train`` and no
    ``val``, there are no held-out records (``val_records() == []``).

    Args:
        train: Path to a ``.jsonl`` / ``.parquet`` file, or a built-in task name
            (``digit_successor``, ``copy_first``, ``add_mod10``, ``word_problems``).
        val: Same for held-out records; ``None`` means the same built-in task with another seed
            (or nothing when ``train`` is a file).
        batch_size: Prompts per training step (per rank).
        num_train_prompts: Records generated for a built-in ``train`` task.
        num_val_prompts: Records generated for a built-in held-out task.
        prompt_key: File field holding the prompt; records are normalised to ``"prompt"``.
        answer_key: File field holding the answer; normalised to ``"answer"``. ``None`` allows
            records without an answer (e.g. for a reward model).
        seed: Seed of built-in tasks and of the training shuffle order.
        shuffle: Shuffle training records each epoch (deterministically from ``seed``).
        task_kwargs: Extra arguments of the built-in task(s), e.g. ``{"prefix_len": 2}``.
        held_out: ``"disjoint"`` or ``"resample"``: how built-in held-out records relate to the
            training records (above).

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
            raise ValueError(
                f"PromptDataModule task_kwargs={task_kwargs!r} only apply to built-in tasks "
                f"{sorted(BUILTIN_TASKS)}, but train={train!r} and val={val!r} are files."
            )
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
        self._train_records: list[dict] | None = None
        self._val_records: list[dict] | None = None

    def _load(self, source: str, num_prompts: int, seed: int, split: Split) -> list[dict]:
        task_kwargs = self.task_kwargs if source in BUILTIN_TASKS else None
        split_or_none = split if self.held_out == "disjoint" else None
        return load_records(
            source, num_prompts, seed, self.prompt_key, self.answer_key, task_kwargs, split=split_or_none
        )

    def setup(self, stage: str | None = None) -> None:
        """Load train and held-out records (idempotent; the data is small and in memory)."""
        if self._train_records is None:
            records = self._load(self.train_source, self.num_train_prompts, self.seed, "train")
            if len(records) < self.batch_size:
                raise ValueError(
                    f"PromptDataModule train={self.train_source!r} has {len(records)} records, fewer than "
                    f"batch_size={self.batch_size}; expected at least batch_size records."
                )
            self._train_records = records
        if self._val_records is None:
            val_source = self.val_source
            if val_source is None:
                val_source = self.train_source if self.train_source in BUILTIN_TASKS else None
            self._val_records = (
                []
                if val_source is None
                else self._load(val_source, self.num_val_prompts, self.seed + VAL_SEED_OFFSET, "held_out")
            )

    def train_records(self) -> list[dict]:
        """All training records (loads them on first call)."""
        self.setup()
        return self._train_records  # type: ignore[return-value]

    def val_records(self) -> list[dict]:
        """All held-out records, in a fixed order (loads them on first call)."""
        self.setup()
        return self._val_records  # type: ignore[return-value]

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        world = trainer.world_size if trainer is not None else 1
        rank = trainer.global_rank if trainer is not None else 0
        return train_loader(self.train_records(), self.batch_size, self.shuffle, self.seed, world, rank)
