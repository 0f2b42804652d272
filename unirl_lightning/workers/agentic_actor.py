"""The agentic endpoints of a rollout worker: multi-turn episodes driven in a thread of the actor.

:class:`AgenticRolloutWorker` is the generic :class:`~unirl_lightning.workers.actor.RolloutWorker`
plus ``agentic_submit`` / ``agentic_poll`` / ``agentic_finalize_if_drained`` / ``agentic_abort`` /
``agentic_evaluate``, which run an :class:`~unirl_lightning.envs.coordinator.EpisodeCoordinator`
(the driver reaches them through :class:`~unirl_lightning.workers.agentic.WorkerEpisodeCoordinator`).
``load_weights`` refuses while a drive is live, so no episode turn straddles two versions; an
evaluation and a training drive take turns on the engine, one generation call at a time.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from unirl_lightning.workers.actor import RolloutWorker

__all__ = ["AgenticRolloutWorker"]


class _SerialEngine:
    """An engine whose ``generate_ids`` holds a lock (everything else is the engine's own)."""

    def __init__(self, engine: Any, lock: threading.Lock) -> None:
        self._engine, self._lock = engine, lock

    def generate_ids(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._engine.generate_ids(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class AgenticRolloutWorker(RolloutWorker):
    """A rollout worker that also plays episodes (the coordinator contract of ``rollout/agentic.py``)."""

    def __init__(
        self, engine_config: Any, policy: Any, lora: Any, reward: Any, worker_index: int = 0
    ) -> None:
        super().__init__(engine_config, policy, lora, reward, worker_index)
        self.coordinator: Any = None  # the EpisodeCoordinator, built by the first agentic_submit
        self._coordinator_settings: Any = None
        self._generation_lock = threading.Lock()  # a training drive and an evaluation take turns

    def load_weights(self, named_tensors: Any, weight_version: int) -> int:
        if self.coordinator is not None and self.coordinator.drive_live:
            raise RuntimeError(
                f"load_weights(weight_version={weight_version}) refused: an agentic drive is live in rollout "
                f"worker {self.worker_index}; quiesce (abort) it first so no episode turn straddles two versions"
            )
        return super().load_weights(named_tensors, weight_version)

    def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.close()
        super().close()

    def agentic_submit(self, env: Any, sampling: Any, episode_settings: Any, requests: list[Any]) -> None:
        """Start a drive of ``requests`` (:class:`~unirl_lightning.envs.coordinator.EpisodeRequest`)."""
        from unirl_lightning.envs.coordinator import EpisodeCoordinator

        settings = (env, sampling, episode_settings)
        if self.coordinator is None or self._coordinator_settings != settings:
            if self.coordinator is not None:
                self.coordinator.close()
            self.coordinator = EpisodeCoordinator(self._episode_engine(), env, sampling, episode_settings)
            self._coordinator_settings = settings
        self.coordinator.submit(requests)

    def agentic_evaluate(
        self, env: Any, sampling: Any, requests: list[Any], timeout_s: float, episode_settings: Any = "drop"
    ) -> list[Any]:
        """Play ``requests`` to the end with the weights held now and return their samples: read-only
        (no weight or version change), with the training episodes' settings except that a failing
        environment ends its episode with reward 0 (``on_env_error="drop"``). A live training drive
        goes on meanwhile, turn by turn in between."""
        import dataclasses

        from unirl_lightning.envs.coordinator import EpisodeCoordinator, EpisodeSettings

        if not isinstance(episode_settings, EpisodeSettings):  # only on_env_error given
            episode_settings = EpisodeSettings()
        settings = dataclasses.replace(episode_settings, on_env_error="drop")
        coordinator = EpisodeCoordinator(self._episode_engine(), env, sampling, settings)
        coordinator.submit(requests)
        deadline = time.monotonic() + timeout_s
        samples: list[Any] = []
        while not coordinator.finalize_if_drained():
            samples += coordinator.poll()
            if time.monotonic() > deadline:
                coordinator.close()
                raise TimeoutError(
                    f"rollout worker {self.worker_index}: {len(requests)} evaluation episodes did not finish "
                    f"within {timeout_s:.0f} s"
                )
            time.sleep(0.005)
        return samples + coordinator.poll()

    def _episode_engine(self) -> Any:
        """The engine as episode coordinators see it: one generation call at a time."""
        if not callable(getattr(self.engine, "generate_ids", None)):
            return self.engine  # the coordinator refuses it, naming the engine
        return _SerialEngine(self.engine, self._generation_lock)

    def agentic_poll(self) -> list[Any]:
        return [] if self.coordinator is None else self.coordinator.poll()

    def agentic_finalize_if_drained(self) -> bool:
        return self.coordinator is None or self.coordinator.finalize_if_drained()

    def agentic_abort(self) -> tuple[list[Any], list[str]]:
        """The samples finished during the abort, and the ids of the episodes it suspended."""
        if self.coordinator is None:
            return [], []
        return self.coordinator.abort(), self.coordinator.suspended()
