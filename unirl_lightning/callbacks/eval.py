"""Held-out evaluation with the weights the rollout workers hold now (read-only)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from unirl_lightning.callbacks.base import RolloutCallback
from unirl_lightning.checks import require_at_least
from unirl_lightning.rollout.types import SamplingParams


class RolloutEvalCallback(RolloutCallback):
    """Score held-out prompts on the rollout workers every ``every_n_steps`` RL steps.

    Read-only by contract: it never pushes weights and never changes the weight version, so the
    score is that of the weights the workers hold (the last pushed version, logged as
    ``eval/weight_version``). Logs ``eval/reward_mean`` and ``eval/accuracy`` (fraction of samples
    whose reward is at least ``accuracy_threshold``). Prompts come from the datamodule's
    ``val_records()`` unless ``prompts`` (a file or built-in task name) is given. For an agentic
    module every sample is a whole episode (every turn, scored by the environment) played on the
    workers beside a live training drive.

    Args:
        every_n_steps: RL steps between evaluations; also evaluates once before training
            (``eval_on_start``) and once at the end (``eval_on_end``).
        num_prompts: held-out prompts per evaluation (the first ``num_prompts``).
        num_generations: samples per prompt.
        temperature: 0 = greedy (diffusion: the deterministic ODE).
        max_new_tokens: token policies only; defaults to the module's training value.

    Example::

        RolloutEvalCallback(every_n_steps=10, num_prompts=64, temperature=0.0)
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        num_prompts: int = 64,
        num_generations: int = 1,
        temperature: float = 0.0,
        max_new_tokens: int | None = None,
        accuracy_threshold: float = 1.0,
        eval_on_start: bool = True,
        eval_on_end: bool = True,
        prompts: str | None = None,
        seed: int = 1234,
    ) -> None:
        self.every_n_steps = require_at_least("every_n_steps", every_n_steps, 1)
        self.num_prompts = require_at_least("num_prompts", num_prompts, 1)
        self.num_generations = require_at_least("num_generations", num_generations, 1)
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.accuracy_threshold = accuracy_threshold
        self.eval_on_start = eval_on_start
        self.eval_on_end = eval_on_end
        self.prompts = prompts
        self.seed = seed
        self.history: list[dict[str, float]] = []
        self._records: list[dict[str, Any]] | None = None

    def _held_out(self, trainer: Any) -> list[dict[str, Any]]:
        if self._records is None:
            if self.prompts is not None:
                from unirl_lightning.data import load_records

                records = load_records(self.prompts, num_prompts=self.num_prompts, seed=self.seed)
            elif trainer.datamodule is not None and hasattr(trainer.datamodule, "val_records"):
                records = trainer.datamodule.val_records()
            else:
                raise RuntimeError(
                    "RolloutEvalCallback needs held-out prompts: pass prompts=<file or task name> or use a "
                    "datamodule with val_records() (PromptDataModule has it)"
                )
            self._records = list(records)[: self.num_prompts]
        return self._records

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self.sampling = pl_module.eval_sampling(self.temperature)
        if self.max_new_tokens is not None:
            if not isinstance(self.sampling, SamplingParams):
                raise ValueError(
                    f"max_new_tokens must be None for {type(pl_module).__name__} (it samples "
                    f"{type(self.sampling).__name__}, which has no token budget), got {self.max_new_tokens}"
                )
            self.sampling = replace(self.sampling, max_new_tokens=self.max_new_tokens)

    def evaluate(self, trainer: Any, pl_module: Any) -> dict[str, float] | None:
        """Evaluate now (rank 0 only, with its workers' weights: every rank holds the same version)."""
        if not trainer.is_global_zero:
            return None
        strategy = self.strategy
        groups = strategy.evaluate(
            self._held_out(trainer), self.sampling, n=self.num_generations, seed=self.seed
        )
        rewards = [r.reward for g in groups for r in g]
        metrics = {
            "eval/reward_mean": sum(rewards) / len(rewards),
            "eval/accuracy": sum(r >= self.accuracy_threshold for r in rewards) / len(rewards),
            "eval/weight_version": float(strategy.weight_version),
        }
        self.history.append({"step": float(strategy.loop.steps if strategy.loop else 0), **metrics})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        return metrics

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.eval_on_start:
            self.evaluate(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.strategy.loop.steps % self.every_n_steps == 0:
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        steps = self.strategy.loop.steps
        if self.eval_on_end and (not self.history or self.history[-1]["step"] != steps):
            self.evaluate(trainer, pl_module)

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict["history"])
