"""filter_groups end to end on real Ray workers with the tiny recipe: zero-variance groups are dropped,
counted and replaced, and every trained batch is full and on-policy at max_staleness 0."""

from __future__ import annotations

import pytest

from tests.builders import fit_tiny, tiny_module
from unirl_lightning.cli.curves import read_scalars
from unirl_lightning.strategy import AsyncRolloutStrategy

pytestmark = pytest.mark.usefixtures("ray_local")


def test_filter_groups_trains_only_groups_with_a_reward_spread(tmp_path):
    strategy = AsyncRolloutStrategy(max_staleness=0, max_inflight=1)
    module = tiny_module(filter_groups=True, max_filter_launches_per_step=50)
    trainer, module, recorder = fit_tiny(tmp_path, max_steps=4, strategy=strategy, module=module)
    assert len(recorder.steps) == 4
    for step in recorder.steps:
        assert step["metrics"]["rollout/zero_variance_groups"] == 0.0
        assert len(step["row_versions"]) == 4 * module.num_generations, "every batch has its 4 groups"
        assert set(step["row_versions"]) == {step["version"]}, (
            "max_staleness 0: trained under its own version"
        )
    scalars = read_scalars(trainer.logger.log_dir)
    filtered = [value for _, value in scalars["rollout/filtered_groups"]]
    assert filtered == sorted(filtered) and filtered[-1] > 0, "a random-init model's groups are often flat"
    assert "rollout/filter_launches" in scalars
