"""Both worker groups are a ``WorkerGroup`` built from one ``WorkerGroupSpec``; the in-process group
reads only the fields that mean something in the training process."""

from __future__ import annotations

import inspect

import pytest

from unirl_lightning.engines.hf import HFEngineConfig
from unirl_lightning.models.causal_lm import TinyCausalLM
from unirl_lightning.rewards import ExactMatchReward
from unirl_lightning.rollout.records import GenerationResult, RolloutRequest
from unirl_lightning.workers.factory import WorkerGroup, WorkerGroupSpec, worker_group_class
from unirl_lightning.workers.inprocess import InProcessWorkerGroup


@pytest.mark.parametrize("placement", ["separate", "hybrid"])
def test_every_group_class_has_every_member_of_the_protocol(placement):
    cls = worker_group_class(placement)
    methods = [name for name in dir(WorkerGroup) if not name.startswith("_")]
    assert [name for name in methods if not callable(getattr(cls, name, None))] == []
    for name in methods:  # the same parameters, by name, as the protocol's
        wanted = list(inspect.signature(getattr(WorkerGroup, name)).parameters)
        have = list(inspect.signature(getattr(cls, name)).parameters)
        assert have[: len(wanted)] == wanted, f"{cls.__name__}.{name}{have} != {wanted}"


def test_the_in_process_group_is_built_from_the_spec_and_answers_a_typed_result():
    spec = WorkerGroupSpec(
        HFEngineConfig(device="cpu", num_threads=None),
        TinyCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
        reward=ExactMatchReward(),
        num_cpus_per_worker=4,  # Ray's resources and restarts: nothing to the in-process group
        num_gpus_per_worker=1,
        max_restarts=7,
        generation_timeout_s=12.0,
    )
    group = InProcessWorkerGroup.from_spec(spec)
    assert group.max_restarts == 0 and group.shares_trainer_device and group.generation_timeout_s == 12.0
    result = group.generate(RolloutRequest(records=[{"prompt": "1", "answer": "2"}], n=3, seed=1)).result()
    assert isinstance(result, GenerationResult) and [len(g) for g in result.groups] == [3]
    assert result.spans[0]["samples"] == 3 and result.generate_s > 0
    with pytest.raises(ValueError, match="num_workers must be 1, got 2"):
        InProcessWorkerGroup.from_spec(WorkerGroupSpec(spec.engine_config, spec.policy, num_workers=2))
