"""Save on the way out: an exception during fit writes last.ckpt (plain types, loadable with
weights_only=True) when the trainer checkpoints, and a resume from it continues the run."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.builders import fit_tiny
from unirl_lightning.strategy import AsyncRolloutStrategy

pytestmark = pytest.mark.usefixtures("ray_local")


class Crash(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 2:
            raise RuntimeError("power cut")


def test_an_exception_writes_last_ckpt_with_the_rollout_state(tmp_path):
    strategy = AsyncRolloutStrategy(max_staleness=1, max_inflight=2)
    periodic = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=100, save_last=True)
    with pytest.raises(RuntimeError, match="power cut"):
        fit_tiny(tmp_path, max_steps=10, strategy=strategy, extra_callbacks=[periodic, Crash()])
    strategy.shutdown()
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 3
    assert checkpoint["unirl_rollout"]["ranks"][0]["steps"] == 3
    assert not list((tmp_path / "ckpt").glob("*.partial")), "the save is written then renamed"
