"""Flow-GRPO end to end on real Ray workers with a tiny real diffusers model: the on-policy ratio pin,
read-only eval, full and LoRA weight-sync equality, the max_inflight refusal, the poll-first order of the
rollout loop, the recipes, and a tiny async run whose reward goes up."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.pytorch import seed_everything

from tests.builders import StepRecorder, count_pushes, make_trainer
from tests.fakes import FakeGenerationHandle
from tests.integration.parse_only import ParseOnlyCLI, init_args
from unirl_lightning.callbacks import (
    RolloutEvalCallback,
    SampleImageLogger,
    WeightSyncCallback,
    WeightVersionLogger,
)
from unirl_lightning.cli.app import run_cli
from unirl_lightning.cli.curves import read_scalars
from unirl_lightning.data import ImagePromptDataModule
from unirl_lightning.engines.diffusion import DiffusionEngineConfig
from unirl_lightning.models.diffusion import TinyFlowModel
from unirl_lightning.models.lora import LoraSpec, effective_weights
from unirl_lightning.modules import FlowGRPOModule
from unirl_lightning.rollout.controller import BatchRolloutController
from unirl_lightning.rollout.loop import RolloutLoop
from unirl_lightning.rollout.records import GenerationResult, RolloutRequest
from unirl_lightning.strategy import AsyncRolloutStrategy
from unirl_lightning.weight_sync import CollectiveWeightSync, ObjectStoreWeightSync, named_weights
from unirl_lightning.weight_sync.base import tensor_bytes
from unirl_lightning.workers import RolloutWorkerGroup

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PRETRAIN_STEPS = 100


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory) -> TinyFlowModel:
    """Pre-trained once for this file; every module and worker below loads it from the cache."""
    spec = TinyFlowModel(pretrain_steps=PRETRAIN_STEPS, cache_dir=str(tmp_path_factory.mktemp("tiny_flow")))
    spec.build()
    return spec


def tiny_module(policy: TinyFlowModel, **overrides) -> FlowGRPOModule:
    kwargs = dict(policy=policy, num_generations=4, num_steps=4, eta=1.0, lr=1e-3, clip_range=1e-3)
    kwargs.update(overrides)
    return FlowGRPOModule(**kwargs)


# -- on-policy: ratio pin, read-only eval, full-weight sync equality, sample images ---------------
@pytest.fixture(scope="module")
def on_policy_run(tmp_path_factory, ray_local, tiny_policy):
    seed_everything(0)
    strategy = AsyncRolloutStrategy(max_staleness=0, max_inflight=1)
    pushes = count_pushes(strategy)
    recorder = StepRecorder()
    evaluator = RolloutEvalCallback(every_n_steps=2, num_prompts=4, num_generations=2)
    callbacks = [
        WeightSyncCallback(),
        WeightVersionLogger(),
        evaluator,
        recorder,
        SampleImageLogger(num_images=4),
    ]
    trainer = make_trainer(tmp_path_factory.mktemp("onpolicy"), strategy, 4, callbacks)
    module = tiny_module(tiny_policy)
    trainer.fit(module, datamodule=ImagePromptDataModule(batch_size=2, num_val_prompts=4))
    yield trainer, module, recorder, evaluator, pushes
    strategy.shutdown()


def test_on_policy_replay_ratio_is_within_1e_4_of_one_at_every_step(on_policy_run):
    _, _, recorder, _, _ = on_policy_run
    assert len(recorder.steps) == 4
    for step in recorder.steps:
        assert set(step["row_versions"]) == {step["version"]}, (
            "max_staleness=0 trained a sample across a sync"
        )
        assert step["metrics"]["train/ratio_dev_max"] < 1e-4, step["metrics"]
        assert step["metrics"]["train/logp_diff_abs"] < 1e-5


def test_eval_uses_the_ode_with_fixed_seeds_and_never_pushes(on_policy_run):
    trainer, module, _, evaluator, pushes = on_policy_run
    strategy = trainer.strategy
    assert pushes == [0, 1, 2, 3, 4], "one push at start-up, then one per step; eval pushed nothing"
    assert [h["eval/weight_version"] for h in evaluator.history] == [0.0, 2.0, 4.0]
    version, num_pushes = strategy.weight_version, len(pushes)
    with torch.no_grad():  # make the trainer's weights differ from the workers'
        for p in module.policy.parameters():
            p.add_(0.5)
    sampling = module.eval_sampling(0.0)
    assert sampling.eta == 0 and sampling.sde_steps() == ()
    first = strategy.evaluate([{"prompt": ""}], sampling, n=3, seed=11)[0]
    again = strategy.evaluate([{"prompt": ""}], sampling, n=3, seed=11)[0]
    assert all(np.array_equal(a.image, b.image) and a.reward == b.reward for a, b in zip(first, again))
    assert strategy.weight_version == version and len(pushes) == num_pushes
    assert evaluator.evaluate(trainer, module)["eval/weight_version"] == version
    scalars = read_scalars(trainer.logger.log_dir)
    assert {"eval/reward_mean", "eval/weight_version", "train/ratio_dev_max", "sync/bytes"} <= set(scalars)


def test_full_weight_sync_leaves_worker_weights_equal_to_the_trainers(on_policy_run):
    trainer, module, _, _, _ = on_policy_run
    strategy = trainer.strategy
    strategy.sync_weights()  # the eval test above perturbed the trainer's weights: push them
    trainer_weights = effective_weights(module.policy)
    (worker_weights,) = strategy.runtime.workers.call("state_dict")
    assert worker_weights.keys() == trainer_weights.keys()
    assert all(torch.equal(worker_weights[k], v) for k, v in trainer_weights.items())
    assert strategy.last_sync["sync/bytes"] == sum(
        v.numel() * v.element_size() for v in trainer_weights.values()
    )


def test_sample_images_are_logged_before_and_after_training(on_policy_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer, module, _, _, _ = on_policy_run
    (logger,) = [c for c in trainer.callbacks if isinstance(c, SampleImageLogger)]
    assert {k: tuple(v.shape) for k, v in logger.images.items()} == {
        "before": (4, 8, 8, 3),
        "after": (4, 8, 8, 3),
    }
    tags = set()
    for path in Path(trainer.logger.log_dir).rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(path), size_guidance={"images": 0})
        accumulator.Reload()
        tags.update(accumulator.Tags()["images"])
    assert {"samples/before", "samples/after"} <= tags


# -- refusals ------------------------------------------------------------------------------------
def test_more_than_one_diffusion_request_in_flight_is_refused_saying_why(tmp_path, tiny_policy):
    strategy = AsyncRolloutStrategy(max_staleness=1, max_inflight=2)
    trainer = make_trainer(tmp_path, strategy, 1, [])
    with pytest.raises(
        ValueError, match=r"max_inflight must be <= 1 for a diffusion policy, got 2: .*~150 s instead of ~8 s"
    ):
        trainer.fit(tiny_module(tiny_policy), datamodule=ImagePromptDataModule(batch_size=2))
    assert strategy.runtime is None, "no worker may start for a refused configuration"


# -- LoRA: adapter-only sync -------------------------------------------------------------------------
def test_lora_sync_moves_a_small_fraction_of_full_bytes_and_matches_effective_weights(ray_local, tiny_policy):
    lora_module = tiny_module(tiny_policy, lora=LoraSpec(rank=2, alpha=4))
    full_bytes = tensor_bytes(named_weights(tiny_module(tiny_policy).policy))  # what a full sync moves
    with torch.no_grad():  # a trained adapter: lora_B is no longer zero
        for param in lora_module.policy.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn_like(param))
    spec = lora_module.rollout_spec()
    workers = RolloutWorkerGroup(DiffusionEngineConfig(), spec.policy, spec.lora)
    collective = CollectiveWeightSync(timeout_s=60)
    try:
        for version, sync in ((1, ObjectStoreWeightSync()), (2, collective)):
            adapter = sync.push(lora_module.policy, workers, version)
            assert adapter.bytes < 0.1 * full_bytes, (adapter.bytes, full_bytes)
            assert workers.call("weight_version") == [version]
            trainer_weights = effective_weights(lora_module.policy)
            (worker_weights,) = workers.call("state_dict")
            assert worker_weights.keys() == trainer_weights.keys()
            assert all(torch.equal(worker_weights[k], v) for k, v in trainer_weights.items()), sync
            with torch.no_grad():  # the next push must carry a change
                next(p for p in lora_module.policy.parameters() if p.requires_grad).add_(0.1)
    finally:
        collective.close()
        workers.shutdown()


# -- the poll-first order (controller level, recording fakes, no Ray) ------------------------------
@dataclass
class FakeRollout:
    reward: float = 0.0
    gen_id: int = -1
    weight_version: int = -1
    reward_parts: dict[str, float] = field(default_factory=dict)


def run_recorded_loop(order: str, max_inflight: int, steps: int = 6, sync_every: int = 2):
    """Drive a RolloutLoop like the strategy does; jobs finish while a step trains. Returns the event log
    and the launches that happened while a finished result was still unreaped."""
    log: list = []
    jobs: list[FakeGenerationHandle] = []
    violations: list[int] = []

    def launch(request: RolloutRequest) -> FakeGenerationHandle:
        if any(job.is_ready and not job.result_calls for job in jobs):
            violations.append(request.gen_id)
        groups = [[FakeRollout(), FakeRollout()] for _ in request.records]
        gen_id = request.gen_id
        job = FakeGenerationHandle(
            GenerationResult(groups, generate_s=0.01),
            on_result=lambda: log.append(("reap", gen_id)),
        )
        log.append(("launch", gen_id))
        jobs.append(job)
        return job

    controller = BatchRolloutController(launch)
    prompts = [[{"prompt": str(i)}] for i in range(100)]
    loop = RolloutLoop(
        prompts,
        controller,
        collate=lambda groups: SimpleNamespace(groups=groups, stats={}),
        build_request=lambda records, gen_id: RolloutRequest(records=records, n=2, gen_id=gen_id),
        max_staleness=1,
        max_inflight=max_inflight,
        sync_interval=sync_every,
        order=order,
    )
    for step in range(steps):
        loop.next_batch()
        log.append(("train", step))
        for job in jobs:  # everything in flight finishes while the step trains
            job.is_ready = True
        if loop.steps % sync_every == 0:
            controller.quiesce()
            controller.sync_weights(lambda version: None)
    return log, violations


def test_poll_first_reaps_every_ready_result_before_any_launch():
    log, violations = run_recorded_loop("poll_first", max_inflight=2)
    assert violations == []
    # the recorder does catch the other order: launch-first tops up before reaping what finished
    _, launch_first_violations = run_recorded_loop("launch_first", max_inflight=2)
    assert launch_first_violations, "the recording fake should see launch_first launch before a reap"


def test_poll_first_with_one_in_flight_launches_the_next_request_before_this_step_trains():
    log, violations = run_recorded_loop("poll_first", max_inflight=1, sync_every=1)
    assert violations == []
    for step in range(5):  # request step + 1 generates while step trains (max_staleness=1)
        assert log.index(("reap", step)) < log.index(("launch", step + 1)) < log.index(("train", step))


# -- the recipes ---------------------------------------------------------------------------------------
def test_gpu_recipe_parses_with_sd35_lora_pickscore_and_one_request_in_flight():
    config = ParseOnlyCLI(
        args=["--config", str(EXAMPLES / "flow_grpo_sd35_pickscore.yaml")], run=False
    ).config
    model = config.model.init_args
    assert config.model.class_path == "unirl_lightning.modules.FlowGRPOModule"
    assert init_args(model.policy).path == "stabilityai/stable-diffusion-3.5-medium"
    assert model.reward.class_path == "unirl_lightning.rewards.image_models.PickScoreReward"
    assert init_args(model.lora).rank == 32 and model.eta == 0.7
    assert config.trainer.strategy.init_args.max_inflight == 1


@pytest.mark.slow
def test_tiny_recipe_reward_goes_up_asynchronously(tmp_path, ray_local, tiny_policy):
    seed_everything(0)
    recorder = StepRecorder()
    cli = run_cli(
        [
            "fit",
            "--config",
            str(EXAMPLES / "flow_grpo_tiny.yaml"),
            "--trainer.max_steps=20",
            "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            f"--model.init_args.policy.init_args.pretrain_steps={PRETRAIN_STEPS}",
            f"--model.init_args.policy.init_args.cache_dir={tiny_policy.cache_dir}",
        ],
        trainer_defaults={"callbacks": [recorder, SampleImageLogger(num_images=0)]},
    )
    try:
        evaluator = next(c for c in cli.trainer.callbacks if isinstance(c, RolloutEvalCallback))
        rewards = [h["eval/reward_mean"] for h in evaluator.history]
        assert len(rewards) == 3 and rewards[-1] > rewards[0] + 0.1, rewards
        staleness = [s["version"] - v for s in recorder.steps for v in s["row_versions"]]
        assert max(staleness) == 1 and min(staleness) >= 0, (
            "async: the next request generates while a step trains"
        )
        assert len(recorder.steps) == 20
    finally:
        cli.trainer.strategy.shutdown()
