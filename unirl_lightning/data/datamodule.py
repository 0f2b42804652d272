"""Prompt records and the :class:`PromptDataModule` that serves them in batches.

Contract: a *prompt record* is a plain dict ``{"prompt": str, "answer": ..., **other_keys}``;
a chat record also has ``"messages"`` (``[{"role": str, "content": str}, ...]``), which
:func:`unirl_lightning.core.prompts.render_prompt` renders instead of ``"prompt"``.
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
from typing import Any, Literal, get_args

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from unirl_lightning.core.seeding import VAL_SEED_OFFSET, held_out_seed
from unirl_lightning.data.reasoning_gym import is_reasoning_gym, reasoning_gym_records
from unirl_lightning.data.sampler import PassSampler, collate_records, train_loader
from unirl_lightning.data.sources import (
    DATASET_BUILDERS,
    SUPPORTED_SUFFIXES,
    PromptRecords,
    load_dataset_source,
    load_prompt_dataset,
    load_records,
)
from unirl_lightning.data.tasks import BUILTIN_TASKS, Partition

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
    "train_loader",
]


HeldOut = Literal["disjoint", "resample"]
"""How :class:`PromptDataModule` draws held-out records of a built-in task (see its docstring)."""


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
        task_kwargs: Extra arguments of the built-in task(s), e.g. ``{"prefix_len": 2}``, or the config
            of a reasoning-gym dataset (``train: "reasoning_gym:<name>"``,
            :mod:`~unirl_lightning.data.reasoning_gym`); with datasets only they are ignored, with one
            warning naming them.
        held_out: ``"disjoint"`` or ``"resample"``: how built-in held-out records relate to the
            training records (above).
        split: The split of a ``DatasetDict`` folder or hub dataset to train on (default ``"train"``).
        val_split: The split of the same source (or of ``val``) to hold out, e.g. ``"test"``.
        subset: A hub dataset's configuration (``load_dataset(<id>, name=subset)``).
        data_files: ``load_dataset``'s ``data_files`` for a hub dataset (a path, list or dict).
        map_fn: ``row -> row`` (or its import path ``"pkg.mod:fn"``), applied to the raw rows of
            train and val (``Dataset.map``) before ``prompt_key``/``answer_key`` are read.
        filter_fn: ``row -> bool`` (or its import path), keeps the rows it is true for, after ``map_fn``.
        max_prompt_length: drop the training and held-out records whose rendered prompt (chat
            template and system prompt included, as the engines render it) is longer than this many
            tokens, counted (``dropped_prompts``, logged as ``data/dropped_prompts/{train,val}``); needs a module
            with ``prompt_length(record)`` (the causal-LM modules). None = keep every record. verl's
            ``filter_overlong_prompts``; TRL truncates instead, which cuts the start off a problem.

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
        max_prompt_length: int | None = None,
    ) -> None:
        super().__init__()
        if max_prompt_length is not None:
            _check_positive_int("max_prompt_length", max_prompt_length)
        if held_out not in get_args(HeldOut):
            raise ValueError(
                f"PromptDataModule held_out={held_out!r} is invalid; expected one of {list(get_args(HeldOut))}."
            )
        _check_positive_int("batch_size", batch_size)
        _check_positive_int("num_train_prompts", num_train_prompts)
        _check_positive_int("num_val_prompts", num_val_prompts)
        uses_task = any(source in BUILTIN_TASKS or is_reasoning_gym(source) for source in (train, val))
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
        self.max_prompt_length = max_prompt_length
        self.dropped_prompts: dict[str, int] = {}
        self._train_records: list[dict] | PromptRecords | None = None
        self._val_records: list[dict] | PromptRecords | None = None

    def _load(
        self, source: str, num_prompts: int, seed: int, partition: Partition, dataset_split: str | None
    ) -> list[dict] | PromptRecords:
        if is_reasoning_gym(source):  # from a seed; held-out and training prompts always disjoint
            kind = "held_out" if partition == "held_out" else "train"
            return reasoning_gym_records(source, num_prompts, seed, self.task_kwargs, partition=kind)
        if source in BUILTIN_TASKS:  # small and generated: a plain list
            return list(
                load_prompt_dataset(
                    source,
                    num_prompts,
                    seed,
                    task_kwargs=self.task_kwargs,
                    partition=partition if self.held_out == "disjoint" else None,
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
        """Load train and held-out records (idempotent; datasets stay memory-mapped), without the
        prompts longer than ``max_prompt_length``."""
        if self._train_records is None:
            records = self._load(self.train_source, self.num_train_prompts, self.seed, "train", self.split)
            records = self._drop_overlong(self._drop_unusable(records, "train"), "train")
            if len(records) < self.batch_size:
                raise ValueError(
                    f"PromptDataModule train={self.train_source!r} has {len(records)} records, fewer than "
                    f"batch_size={self.batch_size}; expected at least batch_size records."
                )
            self._train_records = records
        if self._val_records is None:
            val_source = self.val_source
            if val_source is None:
                builtin = self.train_source in BUILTIN_TASKS or is_reasoning_gym(self.train_source)
                val_source = self.train_source if builtin or self.val_split is not None else None
            self._val_records = (
                []
                if val_source is None
                else self._drop_overlong(
                    self._drop_unusable(
                        self._load(
                            val_source,
                            self.num_val_prompts,
                            held_out_seed(self.seed),
                            "held_out",
                            self.val_split,
                        ),
                        "val",
                    ),
                    "val",
                )
            )

    def _drop_unusable(self, records: list[dict] | PromptRecords, split: str) -> list[dict] | PromptRecords:
        """A dataset's rows without an empty prompt, or without their answer when ``answer_key`` names
        one (the reward scores against it): dropped, counted in ``dropped_prompts["empty/<split>"]`` and
        ``["no_answer/<split>"]``, logged with one warning, and written to the loggers as
        ``data/dropped_prompts/empty/<split>`` and ``.../no_answer/<split>``."""
        if not isinstance(records, PromptRecords):  # a built-in task: generated, never empty
            return records
        prompts = records.rows[records.prompt_key]
        answers = records.rows[records.answer_key] if records.answer_key is not None else None

        def empty(prompt: Any) -> bool:
            if isinstance(prompt, list):  # chat messages: the last user turn is the prompt
                prompt = next(
                    (
                        m.get("content")
                        for m in reversed(prompt)
                        if isinstance(m, dict) and m.get("role") == "user"
                    ),
                    "x",
                )
            return isinstance(prompt, str) and not prompt.strip()

        counts = {"empty": 0, "no_answer": 0}
        keep = []
        for index, prompt in enumerate(prompts):
            if empty(prompt):
                counts["empty"] += 1
            elif answers is not None and (answers[index] is None or answers[index] == ""):
                counts["no_answer"] += 1
            else:
                keep.append(index)
        for reason, count in counts.items():
            self._count_dropped(f"{reason}/{split}", count)
        if len(keep) == len(records):
            return records
        log.warning(
            "PromptDataModule: dropped %d of %d %s rows of %s: %d with an empty prompt, %d without their "
            "answer (%s)",
            len(records) - len(keep),
            len(records),
            split,
            records.source,
            counts["empty"],
            counts["no_answer"],
            f"answer_key={records.answer_key!r}; answer_key=None reads no answer",
        )
        return _subset(records, keep)

    def _drop_overlong(self, records: list[dict] | PromptRecords, split: str) -> list[dict] | PromptRecords:
        """``records`` without those whose prompt is longer than ``max_prompt_length`` tokens (counted
        in ``dropped_prompts[split]``, logged, and written to the trainer's loggers)."""
        if self.max_prompt_length is None:
            return records
        trainer = getattr(self, "trainer", None)
        module = trainer.lightning_module if trainer is not None else None
        length = getattr(module, "prompt_length", None)
        if length is None:
            raise ValueError(
                f"PromptDataModule max_prompt_length={self.max_prompt_length} needs the module's tokenizer: use the "
                f"data module in Trainer.fit with a causal-LM module (got {type(module).__name__})"
            )
        keep = [i for i in range(len(records)) if length(records[i]) <= self.max_prompt_length]
        dropped = len(records) - len(keep)
        self._count_dropped(split, dropped)
        if dropped:
            log.warning(
                "PromptDataModule: dropped %d of %d %s prompts longer than max_prompt_length=%d tokens",
                dropped,
                len(records),
                split,
                self.max_prompt_length,
            )
        return _subset(records, keep)

    def _count_dropped(self, key: str, count: int) -> None:
        """``count`` prompts dropped for ``key`` (``"<split>"`` or ``"<reason>/<split>"``): kept in
        ``dropped_prompts`` and written to the trainer's loggers as ``data/dropped_prompts/<key>``."""
        self.dropped_prompts[key] = count
        trainer = getattr(self, "trainer", None)
        for logger in trainer.loggers if trainer is not None else []:
            logger.log_metrics({f"data/dropped_prompts/{key}": float(count)}, step=0)

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


def _subset(records: list[dict] | PromptRecords, keep: list[int]) -> list[dict] | PromptRecords:
    """The records at the indices ``keep``, in the same form (a list, or a dataset kept memory-mapped)."""
    if not isinstance(records, PromptRecords):  # a list, or reasoning-gym's LazyRecords (then read whole)
        return [records[i] for i in keep]
    return PromptRecords(records.rows.select(keep), records.prompt_key, records.answer_key, records.source)
