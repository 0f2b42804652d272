"""Prompt data: records ``{"prompt", "answer", ...}``, built-in tasks and the datamodule."""

from unirl_lightning.data.datamodule import PromptDataModule, collate_records, load_records
from unirl_lightning.data.tasks import BUILTIN_TASKS, is_held_out, make_task

__all__ = ["BUILTIN_TASKS", "PromptDataModule", "collate_records", "is_held_out", "load_records", "make_task"]
