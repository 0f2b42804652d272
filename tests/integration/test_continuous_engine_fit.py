"""A GRPO fit whose Ray worker batches continuously (a threaded actor taking several requests at once):
the staleness contract holds and the engine's occupancy reaches the logs."""

from __future__ import annotations

from tests.builders import fit_tiny
from unirl_lightning.engines.hf import HFEngineConfig
from unirl_lightning.strategy import AsyncRolloutStrategy


def test_async_fit_on_a_continuously_batching_worker(tmp_path):
    strategy = AsyncRolloutStrategy(
        engine=HFEngineConfig(device="cpu", num_threads=1, batching="continuous", max_batch_size=32),
        max_staleness=1,
        max_inflight=2,
        num_workers=1,
        num_cpus_per_worker=1,
    )
    trainer, _, recorder = fit_tiny(tmp_path, max_steps=5, strategy=strategy)
    assert trainer.global_step == 5
    for step in recorder.steps:
        assert all(0 <= step["version"] - v <= 1 for v in step["row_versions"]), step
    occupancy = [
        s["metrics"]["rollout/engine_occupancy"]
        for s in recorder.steps
        if "rollout/engine_occupancy" in s["metrics"]
    ]
    # time-averaged over the wall clock: this tiny workload leaves the engine idle most of the time
    assert occupancy and all(0 <= x <= 1 for x in occupancy) and max(occupancy) > 0, occupancy
