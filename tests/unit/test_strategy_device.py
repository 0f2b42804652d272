"""``AsyncRolloutStrategy(device="auto")`` follows the Trainer's accelerator: on a machine with a GPU,
``Trainer(accelerator="cpu")`` trains on the CPU (it crashed there with "Device should be CPU, got
cuda:0 instead", found on the first CUDA run). CUDA's presence is declared, as no GPU is here."""

from __future__ import annotations

from unittest import mock

import lightning.pytorch as pl
import torch

from unirl_lightning.strategy import AsyncRolloutStrategy


def trainer(accelerator: str, strategy: AsyncRolloutStrategy) -> pl.Trainer:
    return pl.Trainer(
        accelerator=accelerator, strategy=strategy, logger=False, enable_progress_bar=False, max_steps=1
    )


def test_auto_device_is_cuda_by_itself_and_cpu_under_a_cpu_accelerator():
    with mock.patch("torch.cuda.is_available", return_value=True):
        strategy = AsyncRolloutStrategy(engine="hf")
        assert strategy.root_device == torch.device("cuda", 0)  # alone: the GPU when one is visible
        assert trainer("cpu", strategy).strategy.root_device == torch.device("cpu")


def test_an_explicit_device_is_kept():
    with mock.patch("torch.cuda.is_available", return_value=True):
        strategy = AsyncRolloutStrategy(engine="hf", device="cuda:1")
        # an explicit device is the user's word: Lightning's own check then names the mismatch
        assert strategy.root_device == torch.device("cuda", 1)


def test_without_a_gpu_auto_is_the_cpu():
    with mock.patch("torch.cuda.is_available", return_value=False):
        assert trainer("auto", AsyncRolloutStrategy(engine="hf")).strategy.root_device == torch.device("cpu")
