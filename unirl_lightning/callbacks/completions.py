"""Logs a few prompts with their completions to TensorBoard, as a text table."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.loggers import TensorBoardLogger

from unirl_lightning.algorithms import truncated_completions
from unirl_lightning.callbacks.base import RolloutCallback
from unirl_lightning.callbacks.eval import RolloutEvalCallback
from unirl_lightning.core.checks import require_at_least

COLUMNS = ("prompt", "completion", "reward", "advantage", "staleness", "finish")


def cell(text: str, max_chars: int) -> str:
    """``text`` as one markdown table cell: at most ``max_chars`` characters, pipes escaped, newlines
    shown as ``⏎``."""
    text = text if len(text) <= max_chars else text[: max(0, max_chars - 1)] + "…"
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", " ⏎ ")


def markdown_table(rows: list[dict[str, Any]], max_chars: int) -> str:
    """The rows (dicts keyed by :data:`COLUMNS`, and ``reward parts`` when some row has them) as a
    markdown table; the prompt is shown on its group's first row only."""
    columns = COLUMNS + (("reward parts",) if any(row.get("reward parts") for row in rows) else ())
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    previous = None
    for row in rows:
        values = []
        for key in columns:
            value = row.get(key, "")
            if key == "prompt":
                value, previous = ("" if value == previous else value), value
            values.append(f"{value:.3f}" if isinstance(value, float) else cell(str(value), max_chars))
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


class CompletionLogger(RolloutCallback):
    """Every ``every_n_steps`` RL steps, a text table of the first ``num_prompts`` prompts of the batch
    just trained, each with its completions: the reward, the advantage, the staleness (the version
    trained under minus the row's launch version) and the finish reason, under the TensorBoard tag
    ``rollout/completions``. Held-out evaluations are logged the same way under ``eval/completions``
    by :meth:`log_eval` (with the eval's own rollouts: no advantage, staleness against the version
    the workers hold).

    Source of the texts: the batch a module trains on is tensors only, so the prompt and the
    completion are decoded from its ``input_ids`` with the module's ``tokenizer`` (a causal-LM
    module's; ``num_prompts`` groups only, every ``every_n_steps`` steps). The batch keeps no finish
    reason either: it is read off the row like ``CausalLMModule.truncated_rows`` does (``"length"``: a
    full ``max_new_tokens`` completion whose last token is no stop token of the policy, else
    ``"stop"``). The advantages are those the module's last ``training_step`` computed
    (``last_advantages``; the mean over the completion tokens when they are per token, PPO's). The
    training table shows the total reward (the batch keeps no per-function scores); the eval table
    adds each reward function's own score (the rollouts' ``reward_parts``) when there are any.

    Args:
        every_n_steps: RL steps between tables (the step that is a multiple of it).
        num_prompts: prompts (groups) per table; every sample of each is a row.
        max_chars: the longest prompt or completion shown (longer ones end with ``…``).

    Example::

        Trainer(strategy=AsyncRolloutStrategy(), callbacks=[CompletionLogger(every_n_steps=10, num_prompts=2)])
    """

    def __init__(self, every_n_steps: int = 10, num_prompts: int = 2, max_chars: int = 300) -> None:
        self.every_n_steps = require_at_least("every_n_steps", every_n_steps, 1)
        self.num_prompts = require_at_least("num_prompts", num_prompts, 1)
        self.max_chars = require_at_least("max_chars", max_chars, 1)
        self.last_table: str | None = None
        self._version = 0
        self._stop_ids: list[int] = []
        self._logged_evals: list[Any] = []  # the evaluation groups logged last (compared by identity)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if getattr(pl_module, "tokenizer", None) is None:
            raise ValueError(
                f"CompletionLogger logs text completions: {type(pl_module).__name__} has no tokenizer "
                "(use it with GRPOModule, PPOModule or AgenticGRPOModule; SampleImageLogger for images)"
            )
        self._stop_ids = list(pl_module.policy_spec.stop_ids(pl_module.tokenizer))

    # -- the training batch ---------------------------------------------------------------------
    def batch_rows(self, batch: Any, pl_module: Any, version: int) -> list[dict[str, Any]]:
        """The first ``num_prompts`` groups of ``batch`` as table rows."""
        count = min(batch.num_rows, self.num_prompts * batch.group_size)
        ids = batch.input_ids[:count].cpu()
        response = batch.response_mask[:count].cpu() > 0
        ends = batch.attention_mask[:count].cpu().sum(dim=-1)
        starts = torch.where(response.any(dim=-1), response.float().argmax(dim=-1), ends)
        last = ids.gather(1, (ends - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
        lengths = ends - starts
        truncated = truncated_completions(last, lengths, pl_module.sampling.max_new_tokens, self._stop_ids)
        advantages = pl_module.last_advantages
        if advantages is not None:
            advantages = advantages[:count].detach().float().cpu()
            if advantages.dim() == 2:  # per token: the mean over the completion's loss tokens
                mask = batch.response_mask[:count].cpu()
                advantages = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        decode = pl_module.tokenizer.decode
        rows = []
        for i in range(count):
            start, end = int(starts[i]), int(ends[i])
            rows.append(
                {
                    "prompt": decode(ids[i, :start].tolist(), skip_special_tokens=True),
                    "completion": decode(ids[i, start:end].tolist(), skip_special_tokens=True),
                    "reward": float(batch.rewards[i]),
                    "advantage": float(advantages[i]) if advantages is not None else "",
                    "staleness": version - int(batch.weight_versions[i]),
                    "finish": "length" if bool(truncated[i]) else "stop",
                }
            )
        return rows

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._version = self.strategy.weight_version  # before this step's sync, as staleness is measured

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.is_global_zero and self.strategy.rl_steps % self.every_n_steps == 0:
            rows = self.batch_rows(batch, pl_module, self._version)
            self.write(trainer, "rollout/completions", rows)
        self.log_new_evaluations(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.log_new_evaluations(trainer)

    def log_new_evaluations(self, trainer: Any) -> None:
        """The table of every ``RolloutEvalCallback`` evaluation not yet logged (each callback's
        ``last_groups``; one that ran after this callback in the same step is logged at the next)."""
        for callback in trainer.callbacks:
            groups = (
                getattr(callback, "last_groups", None) if isinstance(callback, RolloutEvalCallback) else None
            )
            if groups is not None and all(groups is not seen for seen in self._logged_evals):
                self._logged_evals = [groups]
                self.log_eval(trainer, groups)

    # -- evaluation -----------------------------------------------------------------------------
    def eval_rows(self, groups: list[list[Any]], version: int) -> list[dict[str, Any]]:
        """The first ``num_prompts`` groups of an evaluation's rollouts as table rows."""
        return [
            {
                "prompt": r.prompt,
                "completion": r.text,
                "reward": float(r.reward),
                "advantage": "",
                "staleness": version - r.weight_version if r.weight_version >= 0 else "",
                "finish": r.finish_reason,
                "reward parts": ", ".join(f"{k}={v:.3f}" for k, v in sorted(r.reward_parts.items())),
            }
            for group in groups[: self.num_prompts]
            for r in group
        ]

    def log_eval(self, trainer: Any, groups: list[list[Any]]) -> str | None:
        """Log an evaluation's rollouts (``RolloutEvalCallback``'s groups) under ``eval/completions``."""
        if not trainer.is_global_zero:
            return None
        return self.write(trainer, "eval/completions", self.eval_rows(groups, self.strategy.weight_version))

    def write(self, trainer: Any, tag: str, rows: list[dict[str, Any]]) -> str:
        table = markdown_table(rows, self.max_chars)
        self.last_table = table
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(tag, table, trainer.global_step)
        return table
