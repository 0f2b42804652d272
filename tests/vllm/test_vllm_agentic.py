"""Multi-turn episodes with vLLM generating (real CPU vLLM in the Ray worker, tiny Llama): the
synchronous pin across turns (ratio 1, rollout log-probs equal to the trainer's on every model token)
and an async run whose every group is trained once or accounted for."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm runs these in .venv-vllm)")

from lightning.pytorch import seed_everything  # noqa: E402

from tests.integration.test_agentic import (  # noqa: E402
    RecordingAgenticModule,
    assert_every_group_accounted_for,
    fit_agentic,
)
from tests.vllm.helpers import tiny_policy  # noqa: E402
from unirl_lightning.data import EpisodeDataModule  # noqa: E402
from unirl_lightning.engines.vllm import VLLMEngineConfig  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

GUESSING = {"class_path": "unirl_lightning.envs.GuessingGameEnv", "init_args": {"syntax": "compact"}}


def fit_on_vllm(tmp_path, *, max_staleness: int, max_inflight: int, max_steps: int):
    seed_everything(0)
    module = RecordingAgenticModule(
        env=GUESSING, policy=tiny_policy(), max_turns=4, num_generations=4, max_new_tokens=2, lr=3e-3
    )
    data = EpisodeDataModule("unirl_lightning.envs:guessing_records", batch_size=4, val_split="train")
    _, loop, recorder = fit_agentic(
        tmp_path,
        module,
        data,
        max_staleness=max_staleness,
        max_inflight=max_inflight,
        max_steps=max_steps,
        engine=VLLMEngineConfig(),
    )
    return module, loop, recorder


def test_sync_multi_turn_pin_holds_with_vllm_generating(tmp_path):
    module, _, recorder = fit_on_vllm(tmp_path, max_staleness=0, max_inflight=1, max_steps=4)
    assert len(recorder.steps) == 4
    gaps = [step["metrics"]["train/logp_diff_abs"] for step in recorder.steps]
    print(f"vLLM multi-turn: logp_diff_abs <= {max(gaps):.2e}")
    for step in recorder.steps:
        assert set(step["row_versions"]) == {step["version"]}, "max_staleness=0 trained across a sync"
        assert abs(step["metrics"]["train/ratio_mean"] - 1.0) < 1e-3
        assert step["metrics"]["train/logp_diff_abs"] < 1e-4
    samples = [s for group in module.trained_groups for s in group]
    assert max(s.num_turns for s in samples) > 1, "the pin must cover later turns, not just the first"


def test_async_multi_turn_on_vllm_keeps_the_bound_and_loses_no_group(tmp_path):
    module, loop, recorder = fit_on_vllm(tmp_path, max_staleness=1, max_inflight=2, max_steps=6)
    assert len(recorder.steps) == 6
    staleness = [step["version"] - v for step in recorder.steps for v in step["row_versions"]]
    assert 0 <= min(staleness) and max(staleness) <= 1
    assert_every_group_accounted_for(loop, module)
