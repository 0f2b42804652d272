"""Save on the way out: an exception during fit writes last.ckpt (plain types, loadable with
weights_only=True) when the trainer checkpoints, and a resume from it continues the run. With
several training ranks nothing is written (a save is a collective a failing rank would wait in)
and one line says so."""

from __future__ import annotations

import logging

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.builders import fit_tiny
from unirl_lightning.callbacks import CheckpointOnExit
from unirl_lightning.strategy import AsyncRolloutStrategy


class Crash(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 2:
            raise RuntimeError("power cut")


@pytest.mark.usefixtures("ray_local")
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


class FakeTrainer:
    """What CheckpointOnExit reads of a trainer, with ``world_size`` ranks; records any save."""

    def __init__(self, folder, world_size: int) -> None:
        self.checkpoint_callback = ModelCheckpoint(folder)
        self.world_size, self.global_rank, self.saved = world_size, 1, []

    def save_checkpoint(self, path) -> None:
        self.saved.append(path)


@pytest.mark.parametrize("periodic", [True, False])
def test_with_several_ranks_nothing_is_saved_and_one_line_says_what_stands(tmp_path, caplog, periodic):
    # a save gathers every rank's rollout state: a rank failing alone would wait in it for the others
    if periodic:
        (tmp_path / "last.ckpt").write_bytes(b"periodic")
    trainer = FakeTrainer(tmp_path, world_size=2)
    with caplog.at_level(logging.WARNING, logger="unirl_lightning.callbacks.exit_checkpoint"):
        CheckpointOnExit().on_exception(trainer, None, RuntimeError("boom"))
    assert trainer.saved == []
    assert [r.getMessage() for r in caplog.records] == [
        "rank 1: no checkpoint saved after RuntimeError (with 2 training ranks a save is a collective the "
        "other ranks may never enter); "
        + (
            f"the periodic {tmp_path / 'last.ckpt'} stands"
            if periodic
            else f"no {tmp_path / 'last.ckpt'} was written yet"
        )
    ]
    if periodic:
        assert (tmp_path / "last.ckpt").read_bytes() == b"periodic"


def test_with_one_rank_the_exit_save_happens_and_is_logged(tmp_path, caplog):
    trainer = FakeTrainer(tmp_path, world_size=1)
    with caplog.at_level(logging.WARNING, logger="unirl_lightning.callbacks.exit_checkpoint"):
        CheckpointOnExit().on_exception(trainer, None, RuntimeError("boom"))
    assert trainer.saved == [str(tmp_path / "last.ckpt")]
    assert [r.getMessage() for r in caplog.records] == [
        f"saved {tmp_path / 'last.ckpt'} after RuntimeError (resume with --ckpt_path last)"
    ]
