"""Rollout workers that die or hang: the run replaces them (a new actor with the current weights, the
lost requests relaunched with their gen_id) and finishes with nothing lost; past max_worker_restarts
it stops with an error naming the worker, the gen_id and the wait."""

from __future__ import annotations

import os
import signal

import pytest
from lightning.pytorch import Callback

from tests.builders import fit_tiny
from unirl_lightning.cli.curves import read_scalars
from unirl_lightning.strategy import AsyncRolloutStrategy

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]


def worker_pid(worker, *_):
    return os.getpid()


class SignalWorker(Callback):
    """Sends ``signum`` to rollout worker 0 at the start of RL step ``at_step`` (a request is in flight)."""

    def __init__(self, signum: int, at_step: int) -> None:
        self.signum, self.at_step, self.pid = signum, at_step, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at_step:
            import ray

            self.pid = ray.get(trainer.strategy.runtime.workers.workers[0].run.remote(worker_pid))
            os.kill(self.pid, self.signum)


class EngineDeadError(RuntimeError):
    """Raised as vLLM's is when its engine core died (matched by name, so vLLM need not be installed)."""


def kill_engine(worker):
    def dead(*args, **kwargs):
        raise EngineDeadError("EngineCore encountered an issue")

    worker.engine.generate = dead


class KillEngine(Callback):
    """Makes rollout worker 0's engine raise ``EngineDeadError`` from RL step ``at_step`` on."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at_step:
            import ray

            ray.get(trainer.strategy.runtime.workers.workers[0].run.remote(kill_engine))


def assert_nothing_lost(trainer, recorder):
    loop = trainer.strategy.runtime.loop
    trained = [g for s in recorder.steps for g in s["gen_ids"]]
    assert len(trained) == len(set(trained)), "a gen_id was trained twice"
    launched = set(range(loop.controller.next_gen_id))
    assert launched == set(trained) | set(loop.recent_evicted_gen_ids) | set(loop.untrained)


def test_a_killed_worker_is_replaced_and_the_run_finishes_with_nothing_lost(tmp_path):
    strategy = AsyncRolloutStrategy(max_staleness=1, max_inflight=2, num_workers=1)
    killer = SignalWorker(signal.SIGKILL, at_step=2)
    try:
        trainer, _, recorder = fit_tiny(tmp_path, max_steps=6, strategy=strategy, extra_callbacks=[killer])
        assert killer.pid is not None and len(recorder.steps) == 6
        assert strategy.runtime.workers.restarts == 1
        assert_nothing_lost(trainer, recorder)
        staleness = [s["version"] - v for s in recorder.steps for v in s["row_versions"]]
        assert max(staleness) <= 1
        restarts = [v for _, v in read_scalars(trainer.logger.log_dir)["rollout/worker_restarts"]]
        assert restarts[0] == 0 and restarts[-1] == 1
    finally:
        strategy.shutdown()


def test_a_worker_killed_mid_stream_under_group_launches_loses_and_repeats_no_group(tmp_path):
    """The streaming configuration (two continuous workers, group launches, pushes without draining):
    worker 0 is killed with groups in flight; its groups are relaunched on its replacement, every
    launched group is trained, evicted (counted) or still held, and none is trained twice."""
    from unirl_lightning.engines.hf import HFEngineConfig

    strategy = AsyncRolloutStrategy(
        engine=HFEngineConfig(device="cpu", num_threads=1, batching="continuous", max_batch_size=32),
        max_staleness=1,
        max_inflight=2,
        num_workers=2,
        num_cpus_per_worker=0.5,
        launch_unit="group",
        sync_mode="continue",
    )
    killer = SignalWorker(signal.SIGKILL, at_step=2)
    try:
        trainer, _, recorder = fit_tiny(tmp_path, max_steps=6, strategy=strategy, extra_callbacks=[killer])
        assert killer.pid is not None and len(recorder.steps) == 6
        assert strategy.runtime.workers.restarts == 1
        assert_nothing_lost(trainer, recorder)
        assert all(len(s["gen_ids"]) == 4 for s in recorder.steps)
    finally:
        strategy.shutdown()


def test_a_worker_whose_engine_died_is_replaced_and_the_run_finishes_with_nothing_lost(tmp_path):
    strategy = AsyncRolloutStrategy(max_staleness=1, max_inflight=2, num_workers=1)
    try:
        trainer, _, recorder = fit_tiny(
            tmp_path, max_steps=5, strategy=strategy, extra_callbacks=[KillEngine(2)]
        )
        assert len(recorder.steps) == 5 and strategy.runtime.workers.restarts == 1
        assert_nothing_lost(trainer, recorder)
    finally:
        strategy.shutdown()


def test_a_hung_worker_is_replaced_after_its_deadline(tmp_path):
    strategy = AsyncRolloutStrategy(max_staleness=1, max_inflight=2, generation_timeout_s=3)
    stopper = SignalWorker(signal.SIGSTOP, at_step=2)
    try:
        trainer, _, recorder = fit_tiny(tmp_path, max_steps=5, strategy=strategy, extra_callbacks=[stopper])
        assert len(recorder.steps) == 5 and strategy.runtime.workers.restarts == 1
        assert_nothing_lost(trainer, recorder)
    finally:
        if stopper.pid is not None:  # the replaced worker was killed; make sure of it
            try:
                os.kill(stopper.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        strategy.shutdown()


def test_a_hung_worker_without_restarts_left_fails_naming_worker_gen_id_and_wait(tmp_path):
    strategy = AsyncRolloutStrategy(
        max_staleness=1, max_inflight=2, generation_timeout_s=2, max_worker_restarts=0
    )
    stopper = SignalWorker(signal.SIGSTOP, at_step=1)
    try:
        # stopped while a request is in flight (the error names its gen_id) or idle before a push (a ping)
        with pytest.raises(
            RuntimeError,
            match=r"rollout worker 0 did not answer (within 2 s \(gen_id \d+\)|a ping within 2 s); no restart left",
        ):
            fit_tiny(tmp_path, max_steps=5, strategy=strategy, extra_callbacks=[stopper])
    finally:
        if stopper.pid is not None:
            try:
                os.kill(stopper.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        strategy.shutdown()
