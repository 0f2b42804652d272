"""The three Lightning strategies with a rollout side: one device (:class:`AsyncRolloutStrategy`),
DDP ranks (:class:`AsyncRolloutDDPStrategy`) and FSDP2 ranks (:class:`AsyncRolloutFSDPStrategy`), each
:class:`~unirl_lightning.strategy.mixin.RolloutStrategyMixin` over Lightning's own strategy; registered
in Lightning's ``StrategyRegistry`` by their ``strategy_name``."""

from __future__ import annotations

import os
import shutil
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import (
    DDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    StrategyRegistry,
)

from unirl_lightning.core.checks import require_positive
from unirl_lightning.runtime import runtime_for
from unirl_lightning.strategy.mixin import RolloutStrategyMixin

__all__ = ["AsyncRolloutDDPStrategy", "AsyncRolloutFSDPStrategy", "AsyncRolloutStrategy"]


class AsyncRolloutStrategy(RolloutStrategyMixin, SingleDeviceStrategy):
    """Train on one device while rollout workers generate asynchronously.

    Args:
        device: the training device, ``"auto"`` = ``cuda:0`` when visible else ``cpu``.
        **rollout: the rollout settings, :meth:`RolloutStrategyMixin.init_rollout` (``engine``, ...).

    Example::

        Trainer(strategy=AsyncRolloutStrategy(engine="hf", max_staleness=1), max_steps=100).fit(module)
    """

    strategy_name = "async_rollout"

    def __init__(self, device: str = "auto", **rollout: Any) -> None:
        self._device_auto = device == "auto"
        if self._device_auto:
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        super().__init__(device=torch.device(device))
        self.init_rollout(**rollout)

    @property
    def root_device(self) -> torch.device:
        """The training device; with ``device="auto"`` the Trainer's accelerator decides it, so
        ``Trainer(accelerator="cpu")`` trains on the CPU of a machine that has a GPU."""
        if self._device_auto and isinstance(self.accelerator, CPUAccelerator):
            return torch.device("cpu")
        return super().root_device


class AsyncRolloutDDPStrategy(RolloutStrategyMixin, DDPStrategy):
    """Train on several ranks with Lightning's DDP while rollout workers generate asynchronously
    (``Trainer(strategy=AsyncRolloutDDPStrategy(...), devices=N, num_nodes=M)``).

    Args:
        process_group_backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU); None = Lightning's choice.
        timeout_s: timeout of every collective of the training process group, and of a collective
            weight sync's waits (the workers' receive included) unless it sets its own.
        find_unused_parameters: DDP's flag (trainable parameters some backward does not reach).
        **rollout: the rollout settings, :meth:`RolloutStrategyMixin.init_rollout` (``num_workers`` is
            per rank).
    """

    strategy_name = "async_rollout_ddp"

    def __init__(
        self,
        process_group_backend: Literal["gloo", "nccl"] | None = None,
        timeout_s: float = 1800.0,
        find_unused_parameters: bool = False,
        **rollout: Any,
    ) -> None:
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=require_positive("timeout_s", timeout_s)),
            find_unused_parameters=find_unused_parameters,
        )
        self.process_group_timeout_s = float(timeout_s)
        self.init_rollout(**rollout)


class AsyncRolloutFSDPStrategy(RolloutStrategyMixin, ModelParallelStrategy):
    """Train on several ranks with sharded parameters (FSDP2, Lightning's ``ModelParallelStrategy``)
    while rollout workers generate asynchronously.

    The module's ``configure_model`` shards its networks over Lightning's ``(num_nodes, devices)``
    mesh, used as HSDP (sharded within a node, replicated across nodes). Every rank is a data-parallel
    replica with prompts and workers of its own. A sync gathers each parameter whole, one tensor at a
    time, and each rank pushes the full weights to its own workers (peak: one gathered tensor on the
    device plus the pushed weights on the host).

    Args:
        process_group_backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU); None = Lightning's choice.
        timeout_s: timeout of every collective of the training process group, and of a collective
            weight sync's waits (the workers' receive included) unless it sets its own.
        save_distributed_checkpoint: True = every rank writes its shard into a checkpoint folder
            (large models); False = one file with the full state, written by rank 0.
        **rollout: the rollout settings, :meth:`RolloutStrategyMixin.init_rollout` (``num_workers`` is
            per rank).

    Example::

        Trainer(strategy=AsyncRolloutFSDPStrategy(max_staleness=1, num_workers=1), accelerator="cpu",
                devices=2, max_steps=100)
    """

    shards_model = True

    strategy_name = "async_rollout_fsdp"

    def __init__(
        self,
        process_group_backend: Literal["gloo", "nccl"] | None = None,
        timeout_s: float = 1800.0,
        save_distributed_checkpoint: bool = False,
        **rollout: Any,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=require_positive("timeout_s", timeout_s)),
        )
        self.process_group_timeout_s = float(timeout_s)
        self.sharded_checkpoints = save_distributed_checkpoint
        self.init_rollout(**rollout)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank is a data-parallel replica with prompts of its own (the mesh shards parameters)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup(self, trainer: Any) -> None:
        module = trainer.lightning_module
        spec = module.rollout_spec()
        runtime_for(spec).check_shardable(spec, type(module).__name__)
        super().setup(trainer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A sharded checkpoint is a folder Lightning writes without ``CheckpointIO``: written next to its
        name, it replaces the old folder once every rank's shard is in it (not atomic: two steps)."""
        path = os.fspath(filepath)
        if not self.sharded_checkpoints or "://" in path:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        partial = f"{path}.partial"
        super().save_checkpoint(checkpoint, partial, storage_options)
        if self.is_global_zero:  # the collective save returned: every shard is in the folder
            if os.path.exists(path):
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            os.replace(partial, path)
        self.barrier("sharded checkpoint in place")


for _cls, _description in (
    (AsyncRolloutStrategy, "Lightning training on one device + asynchronous rollout workers on Ray"),
    (AsyncRolloutDDPStrategy, "Lightning DDP training ranks + asynchronous rollout workers on Ray"),
    (AsyncRolloutFSDPStrategy, "Lightning FSDP2 training ranks + asynchronous rollout workers on Ray"),
):
    if _cls.strategy_name not in StrategyRegistry:
        StrategyRegistry.register(_cls.strategy_name, _cls, description=f"{_description} (unirl_lightning)")
