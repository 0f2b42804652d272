"""A stand-in for an engine with a real sleep mode, on CPU: an HF engine that records its ``sleep``,
``wake(tags)``, ``load_weights`` and ``generate`` calls into a file the driver writes to too (one
event a line, in call order across processes)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from unirl_lightning.engines.hf import HFEngine, HFEngineConfig


def record_event(path: str, event: str) -> None:
    with open(path, "a") as f:
        f.write(event + "\n")


def read_events(path: str) -> list[str]:
    with open(path) as f:
        return f.read().split()


class RecordingHFEngine(HFEngine):
    def _record(self, event: str) -> None:
        record_event(self.config.events_path, event)

    def generate(self, request: Any) -> Any:
        self._record("generate")
        return super().generate(request)

    def load_weights(self, named_tensors: Any, weight_version: int) -> None:
        self._record("push")
        super().load_weights(named_tensors, weight_version)

    def sleep(self) -> None:
        self._record("sleep")
        super().sleep()

    def wake(self, tags: list[str] | None = None) -> None:
        self._record("wake" if tags is None else f"wake({','.join(tags)})")
        super().wake(tags)


@dataclass
class RecordingHFEngineConfig(HFEngineConfig):
    """``enable_sleep_mode`` is resolved for the placement, as vLLM's is (its ``for_placement``: on when
    the engine shares the trainer's device); the engine records it when built."""

    events_path: str = ""
    enable_sleep_mode: bool | None = None

    def for_placement(self, settings: Any) -> RecordingHFEngineConfig:
        if self.enable_sleep_mode is not None:
            return self
        return dataclasses.replace(self, enable_sleep_mode=settings.shares_trainer_device)

    def build(self, policy: Any, lora: Any = None) -> RecordingHFEngine:
        record_event(self.events_path, f"build(enable_sleep_mode={self.enable_sleep_mode})")
        return RecordingHFEngine(self, policy, lora)
