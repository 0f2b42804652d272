"""Held-out evaluation with the weights the rollout workers hold now (read-only)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from unirl_lightning.callbacks.base import RolloutCallback
from unirl_lightning.callbacks.weight_sync import weight_sync_callback
from unirl_lightning.core.checks import require_at_least
from unirl_lightning.rollout.loop import reward_part_means
from unirl_lightning.rollout.records import SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``c`` correct samples out of ``n`` (Chen et al. 2021):
    ``1 - C(n - c, k) / C(n, k)``, the chance that ``k`` of the ``n`` samples drawn without
    replacement hold a correct one.

    >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 2), pass_at_k(4, 0, 4), pass_at_k(4, 3, 2)
    (0.25, 0.5, 0.0, 1.0)
    """
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """pass@k averaged over prompts, from each prompt's ``(n, c)`` (samples, correct samples)."""
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)


@functools.cache
def _majority_checker() -> Any:
    """One :class:`~unirl_lightning.rewards.math_check.AnswerChecker` per process: its cache
    outlives an evaluation."""
    from unirl_lightning.rewards.math_check import AnswerChecker

    return AnswerChecker(timeout_seconds=5)


def majority_correct(completions: Sequence[str], gold: str) -> bool:
    """maj@n of one prompt: the answer most completions give (two answers are the same when
    ``math_verify`` says so; a completion votes when ``math_verify`` extracts an answer from it
    (its check against itself, a parse only), so one with no parsable answer does not; a tie goes to
    the answer given first) is checked against ``gold`` with ``math_verify``. No vote at all counts as wrong. Every check is
    bounded by 5 s on any thread (:class:`~unirl_lightning.rewards.math_check.AnswerChecker`)."""
    check = _majority_checker().check
    votes: list[list[Any]] = []  # [an answer's first text, how many completions gave it]
    for text, checkable in zip(completions, check([(text, text) for text in completions])):
        if not checkable:
            continue
        same = check([(seen, text) for seen, _ in votes])
        if any(same):
            votes[same.index(True)][1] += 1
        else:
            votes.append([text, 1])
    if not votes:
        return False
    best = max(range(len(votes)), key=lambda i: (votes[i][1], -i))
    return check([(str(gold), votes[best][0])])[0]


def group_metrics(
    groups: Sequence[Sequence[Any]],
    records: Sequence[dict[str, Any]] | None,
    threshold: float,
    pass_k: Sequence[int],
    answer_key: str | None,
) -> dict[str, float]:
    """The per-prompt figures of one evaluation: ``eval/pass@k`` for each ``k`` of ``pass_k``,
    ``eval/mean@n`` (each prompt's fraction of correct samples, averaged over prompts) and, when
    ``answer_key`` is given and the samples have text, ``eval/maj@n``. A sample is correct when its
    reward is at least ``threshold``."""
    n = min(len(g) for g in groups)
    counts = [(len(g), sum(r.reward >= threshold for r in g)) for g in groups]
    metrics = {f"eval/pass@{k}": mean_pass_at_k(counts, k) for k in pass_k}
    metrics[f"eval/mean@{n}"] = sum(c / m for m, c in counts) / len(counts)
    texts = all(isinstance(getattr(r, "text", None), str) for g in groups for r in g)
    if answer_key is not None and records is not None and texts:
        golds = [record.get(answer_key) for record in records]
        if all(gold is not None for gold in golds):
            votes = [majority_correct([r.text for r in g], str(gold)) for g, gold in zip(groups, golds)]
            metrics[f"eval/maj@{n}"] = sum(votes) / len(votes)
    return metrics


class RolloutEvalCallback(RolloutCallback):
    """Score held-out prompts on the rollout workers every ``every_n_steps`` RL steps.

    Read-only by contract: it never pushes weights and never changes the weight version, so the
    score is that of the weights the workers hold (the last pushed version, logged as
    ``eval/weight_version``). Logs ``eval/reward_mean`` and ``eval/accuracy`` (fraction of samples
    whose reward is at least ``accuracy_threshold``) and, per reward function,
    ``eval/reward/<name>_mean``; per prompt, ``eval/pass@k`` (the unbiased estimator of Chen et al.
    2021, a sample correct when its reward is at least ``accuracy_threshold``) for ``k = 1``,
    ``k = num_generations`` and each ``k`` of ``pass_k``, ``eval/mean@n`` (the mean fraction of
    correct samples, ``n = num_generations``) and, for token policies whose records carry the
    answer (``answer_key``; math-verify installed), ``eval/maj@n`` (the majority answer math-verify
    extracts, checked against the reference). ``eval/reward_timeouts`` (once one happened): the
    answer checks the evaluations' scoring and maj@n gave up on since the start, each scored wrong.
    Prompts come from the datamodule's ``val_records()`` unless ``prompts`` (a file or built-in task name) is given. For an agentic
    module every sample is a whole episode (every turn, scored by the environment) played on the
    workers beside a live training drive.

    Args:
        every_n_steps: RL steps between evaluations; also evaluates once before training
            (``eval_on_start``) and once at the end (``eval_on_end``, with the final weights). An
            evaluation at RL step ``k`` runs after that step's push when one is due, whatever the
            callbacks' order, so it scores the weights after ``k`` updates; when none is due it
            scores the last pushed step's, and ``eval/weights_step`` logs which step that was.
        num_prompts: held-out prompts per evaluation (the first ``num_prompts``).
        num_generations: samples per prompt.
        temperature: 0 = greedy (diffusion: the deterministic ODE).
        max_new_tokens: token policies only; defaults to the module's training value.
        pass_k: more ``k`` for ``eval/pass@k``, each in ``[1, num_generations]`` (1 and
            ``num_generations`` are always logged).
        answer_key: the record field with the reference answer for ``eval/maj@n``; None = the
            module's reward's ``answer_key`` when it has one (MathVerifyReward), else ``"answer"``; also
            the answer column read from ``prompts``.
        prompt_key: the column holding the prompt in ``prompts``; None = the data module's
            ``prompt_key``, else ``"prompt"``.

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
        pass_k: list[int] | None = None,
        answer_key: str | None = None,
        prompt_key: str | None = None,
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
        for k in pass_k or []:
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_generations:
                raise ValueError(
                    f"pass_k must hold ints in [1, num_generations={num_generations}], got {k!r}"
                )
        self.pass_k = sorted({1, num_generations, *(pass_k or [])})
        self.answer_key = answer_key
        self.prompt_key = prompt_key
        self.validate_only = False  # ``unirl-lightning validate``: evaluate once at fit start, then stop
        self.validated: dict[str, float] | None = None
        self.history: list[dict[str, float]] = []
        self.last_groups: list[list[Any]] | None = None
        self.vote_timeouts = 0  # maj@n's answer checks that ran out
        self._records: list[dict[str, Any]] | None = None

    def _held_out(self, trainer: Any) -> list[dict[str, Any]]:
        if self._records is None:
            if self.prompts is not None:
                from unirl_lightning.data import load_records

                prompt_key = self.prompt_key or getattr(trainer.datamodule, "prompt_key", None) or "prompt"
                records = load_records(  # answer_key: resolved in setup, which runs first
                    self.prompts,
                    self.num_prompts,
                    self.seed,
                    prompt_key=prompt_key,
                    answer_key=self.answer_key,
                )
            elif trainer.datamodule is not None and hasattr(trainer.datamodule, "val_records"):
                records = trainer.datamodule.val_records()
            else:
                raise RuntimeError(
                    "RolloutEvalCallback needs held-out prompts: pass prompts=<file or task name> or use a "
                    "datamodule with val_records() (PromptDataModule has it)"
                )
            self._records = list(records[: self.num_prompts])
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
        if self.answer_key is None:
            self.answer_key = getattr(getattr(pl_module, "reward", None), "answer_key", "answer")

    def evaluate(self, trainer: Any, pl_module: Any) -> dict[str, float] | None:
        """Evaluate now (rank 0 only, with its workers' weights: every rank holds the same version)."""
        if not trainer.is_global_zero:
            return None
        strategy = self.strategy
        records = self._held_out(trainer)
        with strategy.runtime.timeline.measure("eval", cat="eval", prompts=len(records)):
            groups = strategy.evaluate(records, self.sampling, n=self.num_generations, seed=self.seed)
        self.last_groups = groups  # the latest evaluation's rollouts (e.g. for CompletionLogger)
        rewards = [r.reward for g in groups for r in g]
        metrics = {
            "eval/reward_mean": sum(rewards) / len(rewards),
            "eval/accuracy": sum(r >= self.accuracy_threshold for r in rewards) / len(rewards),
            "eval/weight_version": float(strategy.weight_version),
            "eval/weights_step": float(strategy.pushed_step),  # the RL step whose update was scored
        }
        metrics.update(reward_part_means([r for g in groups for r in g], prefix="eval/reward/"))
        metrics.update(self._group_metrics(groups, records))
        timeouts = strategy.runtime.eval_reward_timeouts + self.vote_timeouts
        if timeouts:  # answer checks evaluation gave up on (scored wrong), since the start
            metrics["eval/reward_timeouts"] = float(timeouts)
        self.history.append({"step": float(strategy.rl_steps), **metrics})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        return metrics

    def _group_metrics(self, groups: list[list[Any]], records: list[dict[str, Any]]) -> dict[str, float]:
        answer_key = self.answer_key if isinstance(self.sampling, SamplingParams) else None
        if answer_key is not None:
            try:
                import math_verify  # noqa: F401
            except ImportError:
                answer_key = None
        before = _majority_checker().timeouts  # shared by the process: this callback's share
        metrics = group_metrics(groups, records, self.accuracy_threshold, self.pass_k, answer_key)
        self.vote_timeouts += _majority_checker().timeouts - before
        return metrics

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.validate_only:  # the workers hold the module's weights, pushed at the strategy's setup
            self.validated = self.evaluate(trainer, pl_module)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.eval_on_start:
            self.evaluate(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.strategy.rl_steps % self.every_n_steps == 0:
            # the step's own push first, whatever the callbacks' order
            weight_sync_callback(trainer).push_due()
            metrics = trainer.strategy.broadcast(self.evaluate(trainer, pl_module), src=0)
            # into callback_metrics (not the loggers again), on every rank: ModelCheckpoint(monitor=...)
            # and EarlyStopping read eval/accuracy at this step and at the epoch's end
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, logger=False, batch_size=1)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        steps = self.strategy.rl_steps
        if self.eval_on_end and (not self.history or self.history[-1]["step"] != steps):
            weight_sync_callback(trainer).push_trained()  # score the final weights
            self.evaluate(trainer, pl_module)

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict["history"])
