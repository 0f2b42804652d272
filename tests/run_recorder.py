"""A callback that appends what every RL step trained to a JSON-lines file (for runs in a subprocess)."""

from __future__ import annotations

import json

from lightning.pytorch import Callback


class JsonStepRecorder(Callback):
    """One line per RL step: global step, weight version, row versions, trained prompts, in-flight count."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        tok = pl_module.tokenizer
        prompts = sorted(
            {
                tok.decode(ids[(attn == 1) & (resp == 0)].tolist())
                for ids, attn, resp in zip(batch.input_ids, batch.attention_mask, batch.response_mask)
            }
        )
        self.step = {
            "global_step": trainer.global_step,
            "version": trainer.strategy.weight_version,
            "row_versions": batch.weight_versions.tolist(),
            "prompts": prompts,
            "inflight": batch.stats["rollout/inflight"],
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with open(self.path, "a") as f:
            f.write(json.dumps(self.step) + "\n")
