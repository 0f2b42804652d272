"""Export the trained policy in the Hugging Face layout when training ends."""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info


class ExportOnTrainEnd(Callback):
    """When ``fit`` ends normally, write the policy to ``output`` as ``unirl-lightning export`` does
    (:func:`unirl_lightning.models.export.export_policy`): a ``transformers`` model directory with the
    tokenizer, the LoRA adapter directory (``merge=True``: the merged full model), or the diffusers
    layout of a Flow-GRPO denoiser.

    Global rank 0 writes. Under a sharding strategy (FSDP) every rank first gathers the policy's
    tensors whole (a collective, one tensor at a time), then rank 0 rebuilds an unsharded copy of
    the policy from its spec and writes it; the other ranks wait for it at a barrier. The settings
    are checked when fit starts (``merge`` on a policy without LoRA, a non-empty ``output`` with
    ``overwrite=False``), so a wrong one fails before training, not after.

    Args:
        output: the directory to write; None = ``export`` in the trainer's log directory.
        merge: with a LoRA policy, write the merged full model instead of the adapter.
        overwrite: replace what ``output`` holds (default: a resumed run's export replaces the
            previous one).

    Example::

        Trainer(strategy=AsyncRolloutStrategy(), callbacks=[ExportOnTrainEnd("exported", merge=True)])

        # YAML (LightningCLI)
        # trainer:
        #   callbacks:
        #     - class_path: unirl_lightning.callbacks.ExportOnTrainEnd
        #       init_args: {output: exported, merge: true}
    """

    def __init__(self, output: str | None = None, merge: bool = False, overwrite: bool = True) -> None:
        self.output = output
        self.merge = merge
        self.overwrite = overwrite

    def directory(self, trainer: Any) -> str:
        """Where the export goes for ``trainer``."""
        if self.output is not None:
            return self.output
        return os.path.join(trainer.log_dir or trainer.default_root_dir, "export")

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        from unirl_lightning.models.export import check_merge, check_output

        if stage == "fit" and trainer.is_global_zero:
            check_merge(pl_module, self.merge)
            check_output(self.directory(trainer), self.overwrite)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        from unirl_lightning.distributed.sharding import full_tensor, is_sharded
        from unirl_lightning.models.export import export_policy

        output = self.directory(trainer)
        policy = pl_module.policy
        if any(is_sharded(t) for t in policy.state_dict().values()):  # the same answer on every rank
            state = {name: full_tensor(t).detach().cpu() for name, t in policy.state_dict().items()}
            if trainer.is_global_zero:
                copy = unsharded_policy(pl_module, state)
                export_policy(pl_module, output, self.merge, self.overwrite, policy=copy)
        elif trainer.is_global_zero:
            export_policy(pl_module, output, self.merge, self.overwrite)
        rank_zero_info(f"Exported the trained policy to {output}")
        trainer.strategy.barrier("ExportOnTrainEnd")


def unsharded_policy(pl_module: Any, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A CPU copy of ``pl_module``'s policy built from its spec (LoRA applied as the module does),
    holding ``state`` (the policy's tensors, whole)."""
    from unirl_lightning.models.lora import LLM_LORA_TARGETS, apply_lora

    built = pl_module.policy_spec.build()
    if hasattr(pl_module, "pipeline"):
        network, targets = built.denoiser, built.lora_targets
    else:
        network, targets = built[0], LLM_LORA_TARGETS
    if pl_module.lora is not None:
        network = apply_lora(network, pl_module.lora, targets)
    network.load_state_dict(state)
    return network
