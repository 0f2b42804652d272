"""The rollout runtimes' own rules: which family gets which runtime, each family's scheduling, the CPU
thread rule, the atomic checkpoint write, and where a collective's receive buffers live."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tests.builders import rollout_settings
from unirl_lightning.core.seeding import derive_seed
from unirl_lightning.runtime import cpu_threads, runtime_for
from unirl_lightning.runtime.agentic import AgenticRuntime
from unirl_lightning.runtime.batch import SCHEDULING, BatchRuntime
from unirl_lightning.strategy.checkpoint_io import AtomicCheckpointIO

settings = rollout_settings


def test_each_family_gets_its_runtime():
    assert runtime_for(SimpleNamespace(agentic=None, family="token")) is BatchRuntime
    assert runtime_for(SimpleNamespace(agentic=None, family="diffusion")) is BatchRuntime
    assert runtime_for(SimpleNamespace(agentic=object(), family="token")) is AgenticRuntime


def test_agentic_evaluation_sums_the_answer_checks_its_episodes_environments_gave_up_on():
    runtime = AgenticRuntime(None, settings(), None)
    answers = iter([[[0, 2], [1, 0]], [[0, 0]]])  # per evaluation, per record: each episode's count

    def evaluate(records, sampling, n, seed, timeout_s):
        return [[SimpleNamespace(reward_timeouts=k) for k in group] for group in next(answers)]

    runtime.episodes = SimpleNamespace(evaluate=evaluate)
    runtime.evaluate([{}, {}], None, 2, 0)
    assert runtime.eval_reward_timeouts == 3  # read by RolloutEvalCallback as eval/reward_timeouts
    runtime.evaluate([{}], None, 2, 1)
    assert runtime.eval_reward_timeouts == 3  # since the start: a clean evaluation adds nothing


def test_the_batch_runtime_schedules_diffusion_poll_first_with_one_request_in_flight():
    assert SCHEDULING["token"].order == "launch_first" and SCHEDULING["token"].max_inflight is None
    assert SCHEDULING["diffusion"].order == "poll_first" and SCHEDULING["diffusion"].max_inflight == 1
    spec = SimpleNamespace(agentic=None, family="diffusion")
    BatchRuntime(spec, settings(max_inflight=1), weight_sync=None).check()
    with pytest.raises(
        ValueError, match=r"max_inflight must be <= 1 for a diffusion policy, got 2: .*latents"
    ):
        BatchRuntime(spec, settings(max_inflight=2), weight_sync=None).check()


def test_only_llm_families_are_shardable():
    BatchRuntime.check_shardable(SimpleNamespace(family="token"), "GRPOModule")
    with pytest.raises(ValueError, match="FlowGRPOModule is not one"):
        BatchRuntime.check_shardable(SimpleNamespace(family="diffusion"), "FlowGRPOModule")


def test_ranks_seed_their_episodes_from_a_hash_of_the_seed_and_the_rank():
    assert settings(seed=5, rank=0).rank_seed == 5
    assert settings(seed=5, rank=2).rank_seed == derive_seed(5, 2) != settings(seed=5, rank=1).rank_seed


@pytest.mark.parametrize(
    ("cores", "ranks", "workers", "synchronous", "per_worker", "expected"),
    [
        (2, 1, 1, True, 1, {"trainer": 2, "worker": 2}),  # taking turns: each side gets every core
        (2, 1, 1, False, 1, {"trainer": 1, "worker": 1}),  # overlapping: the worker keeps its core
        (16, 2, 4, False, 2, {"trainer": 4, "worker": 2}),
        (16, 2, 0, False, 2, {"trainer": 8, "worker": 16}),  # workers elsewhere: the trainers take the node
        (2, 1, 4, False, 1, {"trainer": 1, "worker": 1}),  # never below one thread
    ],
)
def test_the_cpu_rule(cores, ranks, workers, synchronous, per_worker, expected):
    assert cpu_threads(cores, ranks, workers, synchronous, per_worker) == expected


def test_the_checkpoint_io_replaces_the_file_whole_and_leaves_no_partial(tmp_path, monkeypatch):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, path)
    real_save = torch.save

    def crash_after_writing(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash_after_writing)
    with pytest.raises(OSError, match="disk full"):
        io.save_checkpoint({"step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"step": 1}, "a failed save never touches the old file"
    io.save_checkpoint({"step": 3}, path)
    assert torch.load(path, weights_only=True) == {"step": 3}
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"], "the next save takes the leftover partial file"
