"""GRPO end to end on real Ray workers with a tiny real Llama: the staleness contract, read-only eval,
weight-sync equality and the TensorBoard tags."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.builders import count_pushes, fit_tiny, tiny_module
from unirl_lightning.cli.curves import read_scalars
from unirl_lightning.strategy import AsyncRolloutStrategy
from unirl_lightning.weight_sync import CollectiveWeightSync, ObjectStoreWeightSync

pytestmark = pytest.mark.usefixtures("ray_local")

REQUIRED_TAGS = [
    "rollout/reward_mean",
    "rollout/weight_version",
    "rollout/staleness_mean",
    "rollout/staleness_max",
    "train/loss",
    "train/ratio_mean",
    "train/clip_fraction",
    "train/logp_diff_abs",
    "train/kl",
    "perf/generate_time_s",
    "perf/train_time_s",
    "sync/time_s",
    "sync/bytes",
    "perf/overlap",
    "eval/reward_mean",
    "eval/accuracy",
    "eval/weight_version",
    # what a user expects besides: learning rate, gradient norm, throughput, reward spread, entropy,
    # lengths and truncation, worker restarts
    "train/lr",
    "train/grad_norm",
    "train/entropy",
    "perf/samples_per_s",
    "perf/tokens_per_s",
    "perf/score_time_s",
    "rollout/reward_std",
    "rollout/zero_variance_groups",
    "rollout/completion_len_max",
    "rollout/truncated_fraction",
    "rollout/worker_restarts",
]


def histogram_tags(log_dir) -> list[str]:
    """The histogram tags under ``log_dir``'s TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for path in Path(log_dir).rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(path), size_guidance={"histograms": 0})
        acc.Reload()
        tags.update(acc.Tags()["histograms"])
    return sorted(tags)


def assert_workers_equal_trainer(strategy, module):
    trainer_state = {k: v.detach().cpu() for k, v in module.policy.state_dict().items()}
    for worker_state in strategy.runtime.workers.call("state_dict"):
        assert worker_state.keys() == trainer_state.keys()
        for name, tensor in trainer_state.items():
            assert torch.equal(worker_state[name], tensor), f"worker weight {name} differs from the trainer's"


@pytest.fixture(scope="module")
def on_policy_run(tmp_path_factory, ray_local):
    strategy = AsyncRolloutStrategy(max_staleness=0, max_inflight=1)
    trainer, module, recorder = fit_tiny(tmp_path_factory.mktemp("onpolicy"), max_steps=6, strategy=strategy)
    yield trainer, module, recorder
    strategy.shutdown()


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, ray_local):
    strategy = AsyncRolloutStrategy(max_staleness=1, max_inflight=2, num_workers=2)
    pushes = count_pushes(strategy)
    module = tiny_module(kl_coef=0.01)
    trainer, module, recorder = fit_tiny(
        tmp_path_factory.mktemp("async"), max_steps=10, strategy=strategy, module=module, eval_every=5
    )
    yield trainer, module, recorder, pushes
    strategy.shutdown()


def test_on_policy_ratio_is_one_and_logprobs_match_at_max_staleness_0(on_policy_run):
    _, _, recorder = on_policy_run
    assert len(recorder.steps) == 6
    for step in recorder.steps:
        assert set(step["row_versions"]) == {step["version"]}, (
            "max_staleness=0 trained a sample across a sync"
        )
        assert abs(step["metrics"]["train/ratio_mean"] - 1.0) < 1e-3
        assert step["metrics"]["train/logp_diff_abs"] < 1e-4


def test_on_policy_run_trains_gen_ids_in_order(on_policy_run):
    _, _, recorder = on_policy_run
    assert [s["gen_ids"] for s in recorder.steps] == [[g] for g in range(6)]


def test_async_staleness_never_exceeds_bound_and_does_occur(async_run):
    _, _, recorder, _ = async_run
    staleness = [s["version"] - v for s in recorder.steps for v in s["row_versions"]]
    assert max(staleness) <= 1
    assert 1 in staleness, "with max_inflight=2 some sample should be one version stale"
    assert min(staleness) >= 0


def test_async_every_gen_id_trained_at_most_once_and_none_lost(async_run):
    trainer, _, recorder, _ = async_run
    loop = trainer.strategy.runtime.loop
    trained = [g for s in recorder.steps for g in s["gen_ids"]]
    assert len(trained) == len(set(trained)), "a gen_id was trained twice"
    launched = set(range(loop.controller.next_gen_id))
    leftover = set(loop.untrained)  # launched, still buffered or in flight at the end
    evicted = set(loop.recent_evicted_gen_ids)
    assert launched == set(trained) | evicted | leftover, "a launched request was silently lost"
    assert not (set(trained) & evicted)
    assert loop.evicted_groups == len(loop.recent_evicted_gen_ids)  # one entry per evicted group


def test_eval_neither_pushes_weights_nor_changes_version(async_run):
    trainer, module, _, pushes = async_run
    strategy = trainer.strategy
    eval_cb = next(c for c in trainer.callbacks if type(c).__name__ == "RolloutEvalCallback")
    version, num_pushes = strategy.weight_version, len(pushes)
    before = strategy.runtime.workers.call("state_dict")
    with torch.no_grad():  # make the trainer's weights differ from the workers'
        for p in module.policy.parameters():
            p.add_(1.0)
    metrics = eval_cb.evaluate(trainer, module)
    assert strategy.weight_version == version
    assert len(pushes) == num_pushes
    assert metrics["eval/weight_version"] == version
    for old, new in zip(before, strategy.runtime.workers.call("state_dict")):
        assert all(torch.equal(old[k], new[k]) for k in old)


def test_pushes_are_one_per_sync_with_consecutive_versions(async_run):
    trainer, _, recorder, pushes = async_run
    # version 0 at start-up (no bump), then one push per step, each one version later
    assert pushes == list(range(0, len(recorder.steps) + 1))
    assert trainer.strategy.weight_version == len(recorder.steps)


def test_tensorboard_has_every_required_tag(async_run):
    trainer, _, _, _ = async_run
    scalars = read_scalars(trainer.logger.log_dir)
    missing = [t for t in REQUIRED_TAGS if t not in scalars]
    assert not missing, f"missing TensorBoard tags: {missing}"
    assert len(scalars["rollout/reward_mean"]) == 10
    assert "rollout/staleness" in histogram_tags(trainer.logger.log_dir)


@pytest.mark.parametrize("backend", ["object_store", "collective"])
def test_weight_sync_leaves_workers_bit_identical_to_trainer(tmp_path, backend, ray_local):
    sync = ObjectStoreWeightSync() if backend == "object_store" else CollectiveWeightSync(timeout_s=60)
    strategy = AsyncRolloutStrategy(max_staleness=1, max_inflight=2, num_workers=2, weight_sync=sync)
    try:
        trainer, module, _ = fit_tiny(tmp_path, max_steps=2, strategy=strategy)
        assert strategy.weight_version == 2
        assert_workers_equal_trainer(strategy, module)
        assert strategy.last_sync["sync/bytes"] == sum(
            v.numel() * v.element_size() for v in module.policy.state_dict().values()
        )
    finally:
        strategy.shutdown()


def test_colocated_engines_sleep_while_training_and_wake_for_the_push(tmp_path, monkeypatch, ray_local):
    from unirl_lightning.workers import RolloutWorkerGroup

    calls: list[str] = []
    call = RolloutWorkerGroup.call

    def recording(self, method, *args, **kwargs):
        if method in ("sleep", "wake"):
            calls.append(f"{method}{args}")
        return call(self, method, *args, **kwargs)

    monkeypatch.setattr(RolloutWorkerGroup, "call", recording)
    strategy = AsyncRolloutStrategy(max_staleness=0, max_inflight=1, placement="colocate")
    try:
        _, _, recorder = fit_tiny(tmp_path, max_steps=3, strategy=strategy)
    finally:
        strategy.shutdown()
    assert calls == ["sleep()", "wake(['weights'],)", "wake(['kv_cache'],)"] * 3  # two-phase wake
    for step in recorder.steps:
        assert abs(step["metrics"]["train/ratio_mean"] - 1.0) < 1e-3
