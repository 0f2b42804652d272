"""The engine contract: what a rollout worker needs from an inference engine.

Called inside a worker process (a Ray actor), one call at a time. Guarantees:

* ``generate(request)`` returns one group per prompt record, ``request.n`` :class:`Rollout`\\ s each,
  with the behaviour log-prob of every sampled token computed at ``request.sampling.temperature``
  (the temperature the trainer recomputes at). Rewards are left at 0: the worker scores them.
* ``load_weights(named_tensors, weight_version)`` replaces the weights it generates with; the
  tensors are full parameters by name (or, for LoRA engines, adapter parameters only).
* ``sleep()`` / ``wake()`` release and restore accelerator memory for colocated placement; engines
  that cannot do it treat both as no-ops.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from unirl_lightning.rollout.types import Rollout, RolloutRequest


def import_backend(module: str, engine: str, install_hint: str) -> Any:
    """``import module``, or an ImportError naming the engine and the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"the {engine} engine needs {engine}, which is not installed: {install_hint}"
        ) from exc


def engine_device(device: str, num_threads: int | None) -> torch.device:
    """Set the worker's torch threads (None = torch's default) and resolve ``"auto"`` to cuda or cpu."""
    if num_threads:
        torch.set_num_threads(num_threads)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


@runtime_checkable
class RolloutEngine(Protocol):
    weight_version: int

    def generate(self, request: RolloutRequest) -> list[list[Rollout]]: ...

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int
    ) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...
