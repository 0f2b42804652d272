"""Prompt records from an environment's record generator (agentic RL), served like PromptDataModule's.

A built-in environment comes with a record generator ``<name>_records(num_prompts, seed=0,
split="train", **options)`` whose ``"train"`` and ``"heldout"`` splits are disjoint
(:mod:`unirl_lightning.envs`); :class:`EpisodeDataModule` calls one by import path and serves the
training split in batches of ``batch_size`` records (one RL step = one batch of prompts, each
played ``num_generations`` times by the agentic loop).
"""

from __future__ import annotations

from typing import Any, Literal

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from unirl_lightning.core.imports import import_callable
from unirl_lightning.core.seeding import episode_held_out_seed
from unirl_lightning.data.datamodule import train_loader

__all__ = ["EpisodeDataModule"]


class EpisodeDataModule(LightningDataModule):
    """Training and held-out records from an environment's record generator.

    Args:
        records: import path of the generator, e.g. ``"unirl_lightning.envs:calculator_records"``.
        record_kwargs: its options (``syntax``, ``digits``, ``low``/``high``, ...), for both splits.
        batch_size: prompts per training step.
        num_train_prompts / num_val_prompts: records generated per split.
        seed: seed of the generator (held-out: ``seed + 1``) and of the training shuffle.
        val_split: the split of the held-out records: ``"heldout"`` (disjoint from training), or
            ``"train"`` for generators without one (the fixed-range guessing game).
        shuffle: shuffle training records each epoch (deterministically from ``seed``).

    Example::

        # YAML
        # data:
        #   class_path: unirl_lightning.data.EpisodeDataModule
        #   init_args:
        #     records: unirl_lightning.envs:calculator_records
        #     record_kwargs: {syntax: compact}
        #     batch_size: 8
    """

    def __init__(
        self,
        records: str,
        record_kwargs: dict[str, Any] | None = None,
        batch_size: int = 8,
        num_train_prompts: int = 1024,
        num_val_prompts: int = 64,
        seed: int = 0,
        val_split: Literal["train", "heldout"] = "heldout",
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        for key, value in (
            ("batch_size", batch_size),
            ("num_train_prompts", num_train_prompts),
            ("num_val_prompts", num_val_prompts),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EpisodeDataModule {key}={value!r} is invalid; expected an int >= 1.")
        if num_train_prompts < batch_size:
            raise ValueError(
                f"EpisodeDataModule num_train_prompts={num_train_prompts} is fewer than batch_size={batch_size}."
            )
        try:
            self.generator = import_callable(records, "records")
        except (ImportError, ValueError, TypeError) as err:
            raise ValueError(
                f"EpisodeDataModule records={records!r} is not an importable record generator "
                f"('package.module:function'): {err}"
            ) from None
        self.records = records
        self.record_kwargs = dict(record_kwargs or {})
        self.batch_size = batch_size
        self.num_train_prompts = num_train_prompts
        self.num_val_prompts = num_val_prompts
        self.seed = seed
        self.val_split = val_split
        self.shuffle = shuffle
        self._train: list[dict[str, Any]] | None = None
        self._val: list[dict[str, Any]] | None = None

    def train_records(self) -> list[dict[str, Any]]:
        if self._train is None:
            self._train = self.generator(self.num_train_prompts, self.seed, "train", **self.record_kwargs)
        return self._train

    def val_records(self) -> list[dict[str, Any]]:
        if self._val is None:
            self._val = self.generator(
                self.num_val_prompts, episode_held_out_seed(self.seed), self.val_split, **self.record_kwargs
            )
        return self._val

    def train_dataloader(self) -> DataLoader:
        return train_loader(self.train_records(), self.batch_size, self.shuffle, self.seed)
