"""A GRPO fit whose Ray worker batches continuously (a threaded actor taking several requests at once):
the staleness contract holds and the engine's occupancy reaches the logs."""

from __future__ import annotations

import pytest

from tests.builders import fit_tiny, tiny_module
from unirl_lightning.engines.hf import HFEngineConfig
from unirl_lightning.strategy import AsyncRolloutStrategy

pytestmark = pytest.mark.usefixtures("ray_local")  # one Ray for the file (a killed worker frees its CPU late)


def fit_continuous(tmp_path, max_steps: int, module=None, **settings):
    """A tiny async fit (``max_staleness=1, max_inflight=2``) on continuously batching workers; every
    trained row within the staleness bound."""
    settings = {"max_staleness": 1, "max_inflight": 2, **settings}
    strategy = AsyncRolloutStrategy(
        engine=HFEngineConfig(device="cpu", num_threads=1, batching="continuous", max_batch_size=32),
        **settings,
    )
    trainer, _, recorder = fit_tiny(tmp_path, max_steps=max_steps, strategy=strategy, module=module)
    assert trainer.global_step == max_steps
    for step in recorder.steps:
        assert all(0 <= step["version"] - v <= settings["max_staleness"] for v in step["row_versions"]), step
    return strategy, recorder


def test_max_staleness_0_stays_exactly_on_policy_with_groups_streamed_and_pushes_without_draining(tmp_path):
    """The streaming configuration (continuous engine, group launches, ``sync_mode="continue"``) at
    ``max_staleness=0, max_inflight=1``: every row sampled by the weights it is trained against (the
    engine's log-probs equal the trainer's, ratio 1)."""
    _, recorder = fit_continuous(
        tmp_path, 5, tiny_module(max_new_tokens=12), max_staleness=0, max_inflight=1, launch_unit="group",
        sync_mode="continue", num_workers=1, num_cpus_per_worker=1,
    )  # fmt: skip
    for step in recorder.steps:
        assert set(step["row_versions"]) == {step["version"]}
        assert abs(step["metrics"]["train/ratio_mean"] - 1.0) < 1e-3
        assert step["metrics"]["train/logp_diff_abs"] < 1e-4


def test_async_fit_on_a_continuously_batching_worker(tmp_path):
    _, recorder = fit_continuous(tmp_path, 5, num_workers=1, num_cpus_per_worker=1)
    occupancy = [
        s["metrics"]["rollout/engine_occupancy"]
        for s in recorder.steps
        if "rollout/engine_occupancy" in s["metrics"]
    ]
    # time-averaged over the wall clock: this tiny workload leaves the engine idle most of the time
    assert occupancy and all(0 <= x <= 1 for x in occupancy) and max(occupancy) > 0, occupancy


def test_group_launches_on_two_continuous_workers_keep_the_bound_and_train_each_prompt_once(tmp_path):
    """``launch_unit="group"``: every prompt is its own launch (gen_id), sent to the least-loaded worker,
    reaped when it finishes; a step trains ``batch_size`` groups, none over the staleness bound, and no
    prompt's group is trained twice."""
    strategy, recorder = fit_continuous(
        tmp_path, 6, num_workers=2, num_cpus_per_worker=0.5, launch_unit="group"
    )
    trained: list[int] = []
    for step in recorder.steps:
        assert len(step["gen_ids"]) == 4, "one gen_id per group, 4 groups a step"
        trained += step["gen_ids"]
    assert len(trained) == len(set(trained)), "a group trained twice"
    loop = strategy.runtime.loop
    assert loop.groups_per_step == 4 and loop.controller.next_gen_id <= 4 * (6 + 2)


def test_group_launch_with_interrupts_is_refused_naming_both_keys():
    with pytest.raises(ValueError, match="launch_unit='group' cannot be combined with sync_mode='interrupt'"):
        AsyncRolloutStrategy(launch_unit="group", sync_mode="interrupt")
    with pytest.raises(ValueError, match="launch_unit must be one of"):
        AsyncRolloutStrategy(launch_unit="prompt")


@pytest.mark.parametrize("sync_mode", ["continue", "quiesce"])
def test_weights_pushed_without_draining_continue_the_rows_in_place_within_the_bound(tmp_path, sync_mode):
    """``sync_mode="continue"``: a sync pushes while groups generate; the rows in flight go on under the
    new weights, so some trained samples hold tokens of two versions (``rollout/interrupted_samples``),
    never one older than ``max_staleness`` (the loop raises on such a token). ``quiesce``, the same run
    otherwise, drains first: no sample spans two versions."""
    long_rows = tiny_module(max_new_tokens=40)  # rows long enough to be mid-way at a push
    _, recorder = fit_continuous(
        tmp_path, 8, long_rows, num_workers=1, num_cpus_per_worker=1, launch_unit="group", sync_mode=sync_mode
    )
    metrics = [s["metrics"] for s in recorder.steps]
    spanning = sum(m.get("rollout/interrupted_samples", 0.0) for m in metrics)
    assert (spanning > 0) == (sync_mode == "continue"), spanning
    assert max(m.get("rollout/token_versions_max_spread", 0.0) for m in metrics) <= 1


def test_continuing_through_a_push_needs_an_engine_that_loads_between_decode_steps():
    from unirl_lightning.core.preflight import continue_engine_error, sync_mode_placement_error

    assert continue_engine_error("continue", HFEngineConfig(batching="continuous")) is None
    assert "sync_mode='continue' pushes weights while generation goes on" in continue_engine_error(
        "continue", HFEngineConfig()
    )
    assert "sync_mode='continue' needs placement='separate'" in sync_mode_placement_error(
        "continue", "colocate"
    )
    with pytest.raises(ValueError, match="sync_mode must be one of"):
        AsyncRolloutStrategy(sync_mode="drain")
    from types import SimpleNamespace

    from tests.builders import rollout_settings
    from unirl_lightning.runtime.agentic import AgenticRuntime

    agentic = AgenticRuntime(SimpleNamespace(family="token"), rollout_settings(sync_mode="continue"), None)
    with pytest.raises(
        ValueError, match="sync_mode='continue' goes on generating through a push, and an agentic"
    ):
        agentic.check()


def test_the_streaming_recipe_runs_as_shipped_from_yaml(tmp_path, monkeypatch):
    """``examples/grpo_tiny_streaming.yaml`` through the CLI (4 steps): the strategy it builds streams
    groups into a continuous engine and pushes without draining; TensorBoard gets the occupancy."""
    from pathlib import Path

    from unirl_lightning.cli.curves import read_scalars
    from unirl_lightning.cli.verbs import main

    recipe = Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny_streaming.yaml"
    monkeypatch.chdir(tmp_path)
    main(
        ["fit", "--config", str(recipe), "--trainer.max_steps", "4", "--trainer.enable_progress_bar", "false"]
    )
    (log_dir,) = Path("runs", "grpo_tiny_streaming").glob("version_*")
    scalars = read_scalars(str(log_dir))
    assert len(scalars["rollout/reward_mean"]) == 4
    assert all(0 <= v <= 1 for _, v in scalars["rollout/engine_occupancy"])
    # the continuous engine counts its steps: the share of the time it stepped, and a step's mean time
    assert scalars["rollout/engine_busy"] and all(0 < v <= 1 for _, v in scalars["rollout/engine_busy"])
    assert scalars["rollout/engine_step_ms"] and all(
        0 < v < 1e3 for _, v in scalars["rollout/engine_step_ms"]
    )
    # ... and its starved slots: with the occupancy, at most the whole slot-time, step by step
    occupancy = dict(scalars["rollout/engine_occupancy"])
    starved = dict(scalars["rollout/engine_starved"])
    assert starved and all(0 <= v <= 1 - occupancy[step] + 1e-6 for step, v in starved.items())
    assert all(v >= 0 for _, v in scalars["rollout/window_headroom"]), "group launches: the window's headroom"
