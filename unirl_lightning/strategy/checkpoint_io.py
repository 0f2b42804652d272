"""How checkpoint files are written: Lightning's ``CheckpointIO`` seam, with an atomic local save.

The rollout strategies install :class:`AtomicCheckpointIO` (a user's own ``CheckpointIO`` plugin,
given to the ``Trainer``, replaces it). Sharded checkpoint folders (FSDP2 with
``save_distributed_checkpoint=True``) do not go through ``CheckpointIO`` in Lightning, so their
replace-as-a-whole stays with :class:`~unirl_lightning.strategy.AsyncRolloutFSDPStrategy`.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` next to the final name, then a rename into place: a crash while saving never
    leaves a half-written checkpoint (``last.ckpt`` is always a whole one, old or new). Remote
    paths (``scheme://``) keep Lightning's own write.

    Example::

        Trainer(strategy=AsyncRolloutStrategy(), plugins=[AtomicCheckpointIO()])  # the default already
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        path = os.fspath(path)
        if "://" in path:
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        partial = f"{path}.partial"
        super().save_checkpoint(checkpoint, partial, storage_options)
        os.replace(partial, path)
