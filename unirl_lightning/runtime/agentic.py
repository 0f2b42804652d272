"""The agentic runtime: multi-turn episodes played by coordinators inside the rollout workers.

Composes the workers' episode coordinators (:class:`~unirl_lightning.workers.agentic.WorkerEpisodeCoordinator`
over :class:`~unirl_lightning.workers.agentic_actor.AgenticRolloutWorker` actors), an
:class:`~unirl_lightning.agentic.controller.AgenticRolloutController` (completion-time version stamps,
one drive at a time, carry/drop tail) and an :class:`~unirl_lightning.agentic.loop.AgenticRolloutLoop`.
Evaluation plays whole episodes on the workers (read-only), taking turns with a live drive.
"""

from __future__ import annotations

from typing import Any

from unirl_lightning.agentic.controller import AgenticRolloutController
from unirl_lightning.agentic.loop import AgenticRolloutLoop
from unirl_lightning.runtime.base import RolloutRuntime
from unirl_lightning.workers.agentic import WorkerEpisodeCoordinator
from unirl_lightning.workers.agentic_actor import AgenticRolloutWorker

__all__ = ["AgenticRuntime"]


class AgenticRuntime(RolloutRuntime):
    """Episodes (the module's ``RolloutSpec.agentic``); see the module docstring."""

    def __init__(
        self, spec: Any, settings: Any, weight_sync: Any, state: dict[str, Any] | None = None
    ) -> None:
        super().__init__(spec, settings, weight_sync, state)
        self.episodes: WorkerEpisodeCoordinator | None = None

    def check(self) -> None:
        if self.settings.sync_mode == "continue":
            raise ValueError(
                "sync_mode='continue' goes on generating through a push, and an agentic module's episodes "
                "abort at a turn boundary at every sync instead: use sync_mode='quiesce' (the turn-level "
                "staleness bound is max_turn_staleness)"
            )
        if self.settings.reward_workers is not None:
            raise ValueError(
                "reward_workers runs a batch module's reward on actors of its own; an agentic module's "
                "episodes are scored inside the workers' environments: set reward_workers to null"
            )
        if self.settings.in_process:
            raise ValueError(
                f"placement={self.settings.placement!r} is not available to agentic modules: their episode "
                "coordinators run inside Ray workers (threads of turns across environments); use "
                "placement='colocate' (synchronous, the trainer's device) or 'separate'"
            )

    def actor_class(self) -> type:
        return AgenticRolloutWorker

    def _make_controller(self, state: dict[str, Any]) -> AgenticRolloutController:
        agentic = self.spec.agentic
        self.episodes = WorkerEpisodeCoordinator(
            self.workers,
            agentic.env,
            self.spec.sampling,
            agentic.episode_settings(),  # forwarded as is to every worker's EpisodeCoordinator
            abort_timeout_s=self.settings.generation_timeout_s,
        )
        return AgenticRolloutController(
            self.episodes,
            self.spec.num_generations,
            agentic.tail_policy,
            start_gen_id=state.get("next_gen_id", 0),
            start_weight_version=state.get("weight_version", 0),
        )

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "agentic/relaunched_episodes": float(self.episodes.relaunched)}

    def make_loop(self, dataloader: Any, sync_interval: int) -> AgenticRolloutLoop:
        settings = self.settings
        return self._restore(
            AgenticRolloutLoop(
                dataloader,
                self.controller,
                self.episodes,
                collate=self.spec.collate,
                num_generations=self.spec.num_generations,
                max_staleness=settings.max_staleness,
                max_inflight=settings.max_inflight,
                max_turn_staleness=self.spec.agentic.max_turn_staleness,
                seed=settings.rank_seed,
                stall_timeout_s=settings.generation_timeout_s,
                extra_stats=self.stats,
            )
        )

    def evaluate(self, records: list[dict[str, Any]], sampling: Any, n: int, seed: int) -> list[list[Any]]:
        groups = self.episodes.evaluate(records, sampling, n, seed, self.settings.generation_timeout_s)
        self.eval_reward_timeouts += sum(sample.reward_timeouts for group in groups for sample in group)
        return groups
