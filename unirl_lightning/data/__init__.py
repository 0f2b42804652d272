"""Prompt data: records ``{"prompt", "answer", ...}``, built-in tasks and the datamodules."""

from unirl_lightning.data.datamodule import (
    PromptDataModule,
    PromptRecords,
    collate_records,
    load_prompt_dataset,
    load_records,
    train_loader,
)
from unirl_lightning.data.episodes import EpisodeDataModule
from unirl_lightning.data.images import ImagePromptDataModule
from unirl_lightning.data.tasks import BUILTIN_TASKS, is_held_out, make_task

__all__ = [
    "BUILTIN_TASKS",
    "EpisodeDataModule",
    "ImagePromptDataModule",
    "PromptDataModule",
    "PromptRecords",
    "collate_records",
    "is_held_out",
    "load_prompt_dataset",
    "load_records",
    "make_task",
    "train_loader",
]
