"""``examples/grpo_smollm2_reasoning_gym.yaml`` runs as shipped (one step here; the learning figures are
``benchmarks/peers/smollm2_learning.py --recipe reasoning_gym``): SmolLM2 on reasoning-gym's prompts,
scored by reasoning-gym's own verifier, with the held-out evaluation in TensorBoard."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.real_model import needs_smollm2

pytest.importorskip("reasoning_gym")
pytestmark = [pytest.mark.slow, needs_smollm2, pytest.mark.usefixtures("ray_local")]

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "grpo_smollm2_reasoning_gym.yaml"


def test_the_reasoning_gym_recipe_runs_as_shipped_and_logs_its_verifiers_scores(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from unirl_lightning.cli.verbs import main

    monkeypatch.chdir(tmp_path)
    main(
        ["fit", "--config", str(RECIPE), "--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false"]
    )
    (log_dir,) = Path("runs", "grpo_smollm2_reasoning_gym").glob("version_*")
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"eval/accuracy", "rollout/reward_mean"} <= tags, sorted(tags)
    (start, *_) = events.Scalars("eval/accuracy")
    assert (
        start.step == 0 and 0.0 < start.value < 0.6
    )  # the untrained model partly solves it (6 of 32 measured)
