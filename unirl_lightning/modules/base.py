"""What every RL LightningModule tells the strategy, and the checkpoint hooks they share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch import LightningModule

from unirl_lightning.rollout.types import ExperienceBatch, SamplingParams

ROLLOUT_STATE_KEY = "unirl_rollout_loop"


@dataclass
class RolloutSpec:
    """The rollout side of a module: the strategy builds workers and the RolloutLoop from it."""

    engine_config: Any
    reward: Any
    num_generations: int
    sampling: SamplingParams
    pad_token_id: int
    order: str = "launch_first"  # diffusion polls first
    collate: Callable[..., ExperienceBatch] | None = None


class RLModule(LightningModule):
    """Base of the RL modules: manual optimization, rollout spec, rollout state in checkpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def rollout_spec(self) -> RolloutSpec:  # pragma: no cover - abstract
        raise NotImplementedError

    def eval_sampling(self, temperature: float, max_new_tokens: int | None) -> Any:  # pragma: no cover
        raise NotImplementedError

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over the trainable parameters of ``self.policy`` (with LoRA: the adapters), from the
        ``lr`` / ``weight_decay`` / ``betas`` hyper-parameters of the subclass."""
        params = [p for p in self.policy.parameters() if p.requires_grad]
        return torch.optim.AdamW(
            params,
            lr=self.hparams.lr,
            weight_decay=self.hparams.weight_decay,
            betas=tuple(self.hparams.betas),
        )

    def log_rollout_stats(self, batch: Any) -> None:
        """Log the loop's per-step rollout/perf figures, the reward on the progress bar (versions and
        staleness are the ``WeightVersionLogger``'s)."""
        n = batch.num_rows
        self.log("rollout/reward_mean", batch.stats["rollout/reward_mean"], prog_bar=True, batch_size=n)
        self.log_dict({k: v for k, v in batch.stats.items() if k != "rollout/reward_mean"}, batch_size=n)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        strategy = self.trainer.strategy
        if hasattr(strategy, "rollout_state_dict"):
            checkpoint[ROLLOUT_STATE_KEY] = strategy.rollout_state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(ROLLOUT_STATE_KEY)
        strategy = self.trainer.strategy if self._trainer is not None else None
        if state is not None and hasattr(strategy, "load_rollout_state_dict"):
            strategy.load_rollout_state_dict(state)
