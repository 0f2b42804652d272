"""The rollout worker: one engine in one Ray actor, generating and scoring what it is asked.

Contract:

* :meth:`RolloutWorker.generate` runs the engine on one request and scores every group inside the
  worker, right after generation, so scoring overlaps training too. A reward scores each sample's
  ``reward_input`` (the text of a token rollout, the image of a diffusion rollout); a reward that
  raises fails the call with :class:`~unirl_lightning.rewards.RewardError`, which names the reward
  and the prompt. The reward is called once per request (every group's samples; a TRL-style
  function also gets ``completion_ids`` and ``finish_reasons``), and each rollout keeps its total
  and, in ``reward_parts``, each reward function's own score.
* :meth:`RolloutWorker.load_weights` takes a push of any backend: a
  :class:`~unirl_lightning.weight_sync.buckets.PackedWeights` from the object store (views of Ray's
  shared memory), a dict or ``(name, tensor)`` pairs. A push streamed in buckets (the object store's
  larger than one bucket) comes as ``begin_weight_push`` -> ``load_weight_bucket`` per bucket ->
  ``finish_weight_push``: each bucket goes to the engine as it arrives
  (:class:`~unirl_lightning.engines.base.BucketedWeightLoader`), or, for an engine without it, is
  copied and the copies are loaded with one ``load_weights`` at the end. The collective backend's endpoints
  (``join_weight_group`` / ``receive_weights`` / ``leave_weight_group``) go to the engine when it is
  a group member of its own (:class:`~unirl_lightning.engines.base.WeightGroupMember`: vLLM, whose
  worker process receives the broadcast); otherwise the worker holds a
  :class:`~unirl_lightning.weight_sync.collective.CollectiveReceiver` whose buffers live on this
  worker's own device, and loads what it receives with ``load_weights``.
* The generic worker knows nothing of episodes; the agentic endpoints are a subclass of their own
  (:class:`~unirl_lightning.workers.agentic_actor.AgenticRolloutWorker`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from unirl_lightning.rollout.records import RolloutRequest
from unirl_lightning.weight_sync.buckets import PackedWeights

__all__ = ["RolloutWorker", "score_groups"]


def score_groups(reward: Any, groups: list[list[Any]], records: list[dict[str, Any]]) -> None:
    """Score every rollout of ``groups`` (``groups[i]`` answers ``records[i]``) with one call of
    ``reward`` (a batched reward sees every group's samples at once): each rollout gets its total
    (``reward``) and each reward function's own score (``reward_parts``). Raises the reward's
    :class:`~unirl_lightning.rewards.RewardError`. Called by the rollout worker, or by a reward worker
    (:mod:`unirl_lightning.workers.reward`) when the strategy sets ``reward_workers``."""
    from unirl_lightning.rewards import score_parts

    rows = [(rollout, record) for group, record in zip(groups, records) for rollout in group]
    rollouts = [rollout for rollout, _ in rows]
    extras = type(rollouts[0]).reward_columns(rollouts) if rollouts else {}
    totals, parts = score_parts(
        reward, [r.reward_input for r in rollouts], [record for _, record in rows], **extras
    )
    for index, rollout in enumerate(rollouts):
        rollout.reward = float(totals[index])
        rollout.reward_parts = {
            name: values[index] for name, values in parts.items() if values[index] is not None
        }


class RolloutWorker:
    """Runs one engine, built from ``engine_config`` for the module's ``policy`` and ``lora``, and
    scores its groups. Ray wraps this class as an actor."""

    def __init__(
        self, engine_config: Any, policy: Any, lora: Any, reward: Any, worker_index: int = 0
    ) -> None:
        self.engine = engine_config.build(policy, lora)
        self.reward = reward
        self.worker_index = worker_index
        self.receiver: Any = None  # the collective backend's group member (join_weight_group)
        self._streamed_version: int | None = None  # the push being streamed (begin_weight_push)
        self._bucket_copies: list[Any] | None = None  # its buckets, for an engine that loads whole pushes

    def generate(self, request: RolloutRequest) -> dict[str, Any]:
        started_at = time.time()  # wall clock: the driver maps it onto its own (timeline.clamp_span)
        start = time.perf_counter()
        groups = self.engine.generate(request)
        generate_s = time.perf_counter() - start
        if self.reward is not None:  # None: a reward worker pool scores (workers/reward.py)
            score_groups(self.reward, groups, request.records)
        return {
            "groups": groups,
            "generate_s": generate_s,
            "score_s": time.perf_counter() - start - generate_s,
            "span": {"start": started_at, "end": time.time()},  # generation and scoring, worker clock
        }

    def load_weights(self, named_tensors: Any, weight_version: int) -> int:
        if isinstance(named_tensors, PackedWeights):  # the object store's push: views of shared memory
            named_tensors = named_tensors.tensors()
        elif isinstance(named_tensors, dict):
            named_tensors = named_tensors.items()
        self.engine.load_weights(named_tensors, weight_version)
        return weight_version

    # -- a push streamed in buckets (weight_sync/object_store.py) ---------------------------------
    def begin_weight_push(self, weight_version: int) -> int:
        from unirl_lightning.engines.base import BucketedWeightLoader

        if isinstance(self.engine, BucketedWeightLoader):
            self.engine.begin_weight_load()
            self._bucket_copies = None
        else:  # the engine takes a whole push: copies of the buckets until the last one
            self._bucket_copies = []
        self._streamed_version = weight_version
        return weight_version

    def load_weight_bucket(self, bucket: Any) -> int:
        version = self._streamed_version
        if version is None:
            raise RuntimeError(
                f"rollout worker {self.worker_index}: load_weight_bucket before begin_weight_push"
            )
        named = bucket.tensors() if isinstance(bucket, PackedWeights) else list(dict(bucket).items())
        if self._bucket_copies is None:
            self.engine.load_weight_bucket(named)
        else:
            self._bucket_copies.extend((name, t.clone()) for name, t in named)
        return version

    def finish_weight_push(self, weight_version: int | None) -> int | None:
        """End the streamed push: the engine serves ``weight_version`` from now on; None ends an
        interrupted push (the engine keeps its version)."""
        begun, copies = self._streamed_version is not None, self._bucket_copies
        self._bucket_copies, self._streamed_version = None, None
        if not begun:  # nothing was begun (an interrupted push that never reached this worker)
            return None
        if copies is not None:
            if weight_version is not None:
                self.engine.load_weights(copies, weight_version)
        else:
            self.engine.finish_weight_load(weight_version)
        return weight_version

    # -- the collective backend's endpoints (weight_sync/collective.py) ---------------------------
    def _group_member(self) -> Any:
        """The engine, when it joins the weight-sync group itself (e.g. vLLM's worker process), else None."""
        from unirl_lightning.engines.base import WeightGroupMember

        return self.engine if isinstance(self.engine, WeightGroupMember) else None

    def join_weight_group(
        self, backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float
    ) -> int:
        member = self._group_member()
        if member is not None:
            member.join_weight_group(backend, host, port, rank, world_size, timeout_s)
            self.receiver = member
            return rank
        from unirl_lightning.weight_sync.collective import CollectiveReceiver

        self.receiver = CollectiveReceiver(backend, host, port, rank, world_size, timeout_s)
        return rank

    def receive_weights(self, layout: Any, dtypes: Any, weight_version: int) -> int:
        if self.receiver is None:
            raise RuntimeError(
                f"rollout worker {self.worker_index}: receive_weights(weight_version={weight_version}) before "
                "join_weight_group"
            )
        if self.receiver is self.engine:  # the engine's own member receives and loads
            self.engine.receive_weights(layout, dtypes, weight_version)
            return weight_version
        return self.load_weights(self.receiver.receive(layout, dtypes), weight_version)

    def leave_weight_group(self) -> None:
        if self.receiver is not None and self.receiver is self.engine:
            self.engine.leave_weight_group()
        self.receiver = None

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(worker, *args)`` in the worker (a probe for tests and debugging)."""
        return fn(self, *args, **kwargs)

    def weight_version(self) -> int:
        return self.engine.weight_version

    def placement_info(self) -> dict[str, Any]:
        """Where this worker runs: its index, node, Ray GPU ids and ``CUDA_VISIBLE_DEVICES``."""
        from unirl_lightning.workers.placement import actor_placement_info

        return {"worker": self.worker_index, **actor_placement_info()}

    def state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self, tags: list[str] | None = None) -> None:
        """Wake the engine: all of it (None) or only ``tags`` (``["weights"]``, ``["kv_cache"]``)."""
        self.engine.wake(tags)

    def close(self) -> None:
        self.engine.close()
