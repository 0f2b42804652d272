"""Prompt data: records ``{"prompt", "answer", ...}``, built-in toy tasks and the datamodule."""

from unirl_lightning.data.datamodule import PromptDataModule, collate_records, load_records
from unirl_lightning.data.tasks import BUILTIN_TASKS, make_task

__all__ = ["BUILTIN_TASKS", "PromptDataModule", "collate_records", "load_records", "make_task"]
