"""Builders of tiny real runs (GRPO, PPO, Flow-GRPO; HF and vLLM engines): a quiet Trainer, a tiny
module, data, a recording callback and a push counter."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from unirl_lightning.callbacks import RolloutEvalCallback, WeightSyncCallback, WeightVersionLogger
from unirl_lightning.data import PromptDataModule
from unirl_lightning.models.causal_lm import TinyCausalLM
from unirl_lightning.modules import CausalLMModule, GRPOModule
from unirl_lightning.rewards import ExactMatchReward
from unirl_lightning.strategy import AsyncRolloutStrategy


class StepRecorder(Callback):
    """Records, at every step, what was trained and under which version, plus the logged metrics."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.append(
            {
                "version": trainer.strategy.weight_version,
                "row_versions": batch.weight_versions.tolist(),
                "gen_ids": sorted(set(batch.gen_ids.tolist())),
            }
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        metrics.update(pl_module.last_logged_metrics)  # the figures logged straight to the loggers
        self.steps[-1]["metrics"] = metrics


def make_trainer(tmp_path, strategy, max_steps: int, callbacks: list) -> Trainer:
    """A quiet Trainer that logs every step to TensorBoard under ``tmp_path``."""
    return Trainer(
        strategy=strategy,
        max_steps=max_steps,
        callbacks=callbacks,
        logger=TensorBoardLogger(str(tmp_path), name="run"),
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        log_every_n_steps=1,
    )


def count_pushes(strategy: AsyncRolloutStrategy) -> list[int]:
    """Record the version of every weight push the strategy makes (the list fills as it runs)."""
    pushes: list[int] = []
    push = strategy.weight_sync.push

    def counting_push(model, workers, version):
        pushes.append(version)
        return push(model, workers, version)

    strategy.weight_sync.push = counting_push
    return pushes


def tiny_module(module_cls: type[CausalLMModule] = GRPOModule, **overrides: Any) -> CausalLMModule:
    """A GRPO (or PPO) module on a one-layer tiny Llama with exact-match reward."""
    kwargs = dict(
        policy=TinyCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
        reward=ExactMatchReward(),
        num_generations=4,
        max_new_tokens=2,
        lr=3e-3,
    )
    kwargs.update(overrides)
    return module_cls(**kwargs)


def fit_tiny(
    tmp_path,
    *,
    max_steps: int,
    strategy: AsyncRolloutStrategy,
    sync_every: int = 1,
    extra_callbacks: list | None = None,
    module: CausalLMModule | None = None,
    eval_every: int | None = None,
    batch_size: int = 4,
):
    seed_everything(0)
    recorder = StepRecorder()
    callbacks = [
        WeightSyncCallback(every_n_steps=sync_every),
        WeightVersionLogger(histogram_every_n_steps=1),
        recorder,
    ]
    if eval_every:
        callbacks.append(RolloutEvalCallback(every_n_steps=eval_every, num_prompts=8))
    callbacks += extra_callbacks or []
    trainer = make_trainer(tmp_path, strategy, max_steps, callbacks)
    module = module or tiny_module()
    data = PromptDataModule(
        train="digit_successor", batch_size=batch_size, num_train_prompts=64, num_val_prompts=8
    )
    trainer.fit(module, datamodule=data)
    return trainer, module, recorder


def rollout_settings(**overrides: Any) -> Any:
    """The strategy's rollout settings as a runtime reads them, at the strategy's defaults (one CPU worker,
    no restarts, a short deadline) with ``overrides``."""
    from unirl_lightning.runtime import RolloutSettings

    values = dict(
        engine="auto",
        max_staleness=1,
        max_inflight=2,
        num_workers=1,
        num_cpus_per_worker=1,
        num_gpus_per_worker=0,
        placement="separate",
        seed=0,
        trainer_threads=None,
        generation_timeout_s=60.0,
        max_worker_restarts=0,
    )
    return RolloutSettings(**{**values, **overrides})
