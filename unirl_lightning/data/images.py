"""Prompt records for image policies: a prompt file, or built-in records for the tiny model.

Shares :class:`~unirl_lightning.data.PromptDataModule`'s loading (:func:`load_records` for
``.jsonl`` / ``.parquet``) and its training loader (:func:`train_loader`), and adds ``.txt``
prompt files (one prompt per line, as in Flow-GRPO's prompt sets) and built-in colour records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from unirl_lightning.core.checks import require_at_least
from unirl_lightning.data.datamodule import load_records, train_loader

__all__ = ["ImagePromptDataModule"]


class ImagePromptDataModule(LightningDataModule):
    """Prompt records for image policies: a prompt file, or built-in records for the tiny model.

    ``train_dataloader()`` yields ``list[dict]`` batches of ``batch_size`` records (last partial
    batch dropped); :meth:`val_records` returns the held-out records (the eval callback and the
    sample-image logging use them).

    Args:
        train: a prompt file: ``.txt`` (one prompt per line, as in Flow-GRPO's prompt sets),
            ``.jsonl`` or ``.parquet`` (field ``prompt_key``); None = built-in records:
            ``num_prompts`` records ``{"prompt": "colour k", "label": k}`` cycling over
            ``num_classes`` labels (``num_classes=0``: unconditional, ``{"prompt": ""}``).
        val: held-out prompt file; None = the built-in records (or the first ``num_val_prompts``
            of ``train``).
        batch_size: prompts per RL step.

    Example::

        ImagePromptDataModule(batch_size=4)                          # the tiny unconditional model
        ImagePromptDataModule(train="prompts/pickscore_train.txt", batch_size=8)
    """

    def __init__(
        self,
        train: str | None = None,
        val: str | None = None,
        batch_size: int = 4,
        num_prompts: int = 64,
        num_val_prompts: int = 8,
        num_classes: int = 0,
        prompt_key: str = "prompt",
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        require_at_least("batch_size", batch_size, 1)
        require_at_least("num_prompts", num_prompts, 1)
        self.train_source, self.val_source = train, val
        self.batch_size = batch_size
        self.num_prompts, self.num_val_prompts = num_prompts, num_val_prompts
        self.num_classes = num_classes
        self.prompt_key = prompt_key
        self.shuffle, self.seed = shuffle, seed

    def _builtin(self, count: int) -> list[dict[str, Any]]:
        if not self.num_classes:
            return [{"prompt": ""} for _ in range(count)]
        return [
            {"prompt": f"colour {i % self.num_classes}", "label": i % self.num_classes} for i in range(count)
        ]

    def _load(self, source: str) -> list[dict[str, Any]]:
        path = Path(source).expanduser()
        if path.suffix.lower() == ".txt":
            if not path.is_file():
                raise FileNotFoundError(f"prompt file {source!r} does not exist (looked at {path.resolve()})")
            prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
            if not prompts:
                raise ValueError(f"prompt file {source!r} contains no prompts")
            return [{"prompt": p} for p in prompts]
        return load_records(source, prompt_key=self.prompt_key, answer_key=None)

    def train_records(self) -> list[dict[str, Any]]:
        records = (
            self._builtin(self.num_prompts) if self.train_source is None else self._load(self.train_source)
        )
        if len(records) < self.batch_size:
            raise ValueError(
                f"ImagePromptDataModule has {len(records)} training prompts, fewer than batch_size={self.batch_size}"
            )
        return records

    def val_records(self) -> list[dict[str, Any]]:
        if self.val_source is not None:
            return self._load(self.val_source)
        if self.train_source is None:
            return self._builtin(self.num_val_prompts)
        return self.train_records()[: self.num_val_prompts]

    def train_dataloader(self) -> DataLoader:
        return train_loader(self.train_records(), self.batch_size, self.shuffle, self.seed)
