"""What a module asks the strategy to serve: :class:`RolloutSpec`, read by the strategy at setup."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unirl_lightning.agentic.loop import AgenticSpec
from unirl_lightning.rollout.records import PolicyFamily

__all__ = ["RolloutSpec"]


@dataclass
class RolloutSpec:
    """The rollout side of a module, read by the strategy.

    Attributes:
        policy: the policy spec every engine builds (``build()`` in the worker).
        lora: the LoRA spec the trainer trains with (engines wrap the policy the same way), or None.
        reward: scores each sample in the worker.
        num_generations: samples per prompt (the group size).
        sampling: the engine's sampling parameters (``SamplingParams`` / ``DiffusionSampling``).
        collate: ``collate(groups) -> batch`` of the module's batch type.
        family: ``"token"`` (causal LMs) or ``"diffusion"``; ``engine="auto"`` serves it with the
            family's default engine, and the family's runtime schedules its requests
            (:data:`unirl_lightning.runtime.batch.SCHEDULING`).
        agentic: multi-turn episodes (:class:`~unirl_lightning.agentic.loop.AgenticSpec`:
            environment, tail policy, environment errors); the strategy then drives an
            :class:`~unirl_lightning.agentic.loop.AgenticRolloutLoop`. None = single-turn.
        filter_groups: drop groups whose rewards are all equal before training and launch more
            prompts until the step's batch is full (DAPO's dynamic sampling; batch runtime only).
        max_filter_launches_per_step: the most extra requests one step may launch to replace
            dropped groups; a step that needs more raises.
    """

    policy: Any
    lora: Any
    reward: Any
    num_generations: int
    sampling: Any
    collate: Callable[[list[list[Any]]], Any]
    family: PolicyFamily = "token"
    agentic: AgenticSpec | None = None
    filter_groups: bool = False
    max_filter_launches_per_step: int = 10
