"""Save on the way out: an exception or Ctrl-C writes the last checkpoint when checkpointing is on
(one training rank; with several, nothing is written and the periodic ``last.ckpt`` stands)."""

from __future__ import annotations

import logging
import os
from typing import Any

from lightning.pytorch.callbacks import Callback, ModelCheckpoint

log = logging.getLogger(__name__)


class CheckpointOnExit(Callback):
    """On an exception or Ctrl-C during fit, write ``last.ckpt`` into the ``ModelCheckpoint``'s folder.

    Only when the trainer checkpoints (it has a ``ModelCheckpoint``), so ``--ckpt_path last`` resumes
    from the moment the run stopped instead of the last periodic checkpoint. The strategy writes it
    atomically (a temporary file in the same folder, then a rename), so a crash while saving never
    leaves a half-written ``last.ckpt``. The batch that was being trained counts as trained (its
    prompts are not relaunched), so nothing is trained twice. A failure to save is logged, never
    raised (the original error stays the one reported). RL modules add this callback by default.

    With several training ranks nothing is written: a save gathers every rank's rollout state (a
    collective), and a rank that failed alone would wait in it for ranks that never come. One line is
    logged instead, naming what stands (the periodic ``last.ckpt``, if any).
    """

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        checkpoint = trainer.checkpoint_callback
        if not isinstance(checkpoint, ModelCheckpoint) or checkpoint.dirpath is None:
            return
        path = os.path.join(
            checkpoint.dirpath, f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{checkpoint.FILE_EXTENSION}"
        )
        why = type(exception).__name__
        if trainer.world_size > 1:
            stands = f"the periodic {path} stands" if os.path.exists(path) else f"no {path} was written yet"
            log.warning(
                "rank %d: no checkpoint saved after %s (with %d training ranks a save is a collective "
                "the other ranks may never enter); %s",
                trainer.global_rank,
                why,
                trainer.world_size,
                stands,
            )
            return
        try:
            trainer.save_checkpoint(path)
            log.warning("saved %s after %s (resume with --ckpt_path last)", path, why)
        except Exception:  # noqa: BLE001 - keep the original error the one the user sees
            log.exception("could not save a checkpoint after %s", why)
