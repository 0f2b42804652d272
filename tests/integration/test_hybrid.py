"""``placement="hybrid"`` end to end: the engine in the training process, on the same controller, loop,
stamps, evaluation and checkpoints as Ray workers. The tiny recipe learns, holds the on-policy pin,
checkpoints and resumes in a process where ``ray`` cannot be imported; the pin holds on a real model
(SmolLM2, HF engine); the CLI refuses a Ray backend with hybrid at parse time, naming both keys."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.builders import count_pushes, fit_tiny, tiny_module
from tests.unit.real_model import needs_smollm2
from unirl_lightning.cli.curves import read_scalars
from unirl_lightning.strategy import AsyncRolloutStrategy
from unirl_lightning.weight_sync import InProcessWeightSync

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "grpo_tiny_hybrid.yaml"
HYBRID = {"placement": "hybrid", "max_staleness": 0, "max_inflight": 1}


def assert_on_policy(steps):
    for step in steps:
        assert set(step["row_versions"]) == {step["version"]}, "a sample crossed a sync"
        assert abs(step["metrics"]["train/ratio_mean"] - 1.0) < 1e-3
        assert step["metrics"]["train/logp_diff_abs"] < 1e-4


def test_hybrid_tiny_fit_is_on_policy_shares_the_trainers_tensors_and_eval_never_pushes(tmp_path):
    strategy = AsyncRolloutStrategy(**HYBRID)
    pushes = count_pushes(strategy)
    try:
        trainer, module, recorder = fit_tiny(tmp_path, max_steps=4, strategy=strategy, eval_every=2)
        assert len(recorder.steps) == 4
        assert_on_policy(recorder.steps)
        assert [s["gen_ids"] for s in recorder.steps] == [[g] for g in range(4)]
        assert pushes == [0, 1, 2, 3, 4]  # start-up, then one per step: evaluations pushed nothing
        assert all(s["metrics"]["sync/bytes"] == 0 for s in recorder.steps[1:])  # float32: no copy
        engine = strategy.runtime.workers.workers[0].engine
        served = engine.model.state_dict()
        for name, tensor in module.policy.state_dict().items():
            assert served[name].data_ptr() == tensor.data_ptr(), f"{name} is a copy"
        version = strategy.weight_version
        groups = strategy.evaluate([{"prompt": "12 d=", "answer": "3"}], module.sampling, n=2)
        assert len(groups[0]) == 2 and strategy.weight_version == version and len(pushes) == 5
        assert isinstance(strategy.weight_sync, InProcessWeightSync)
        placement = (Path(trainer.log_dir) / "placement.json").read_text()
        assert '"in_process": true' in placement
    finally:
        strategy.shutdown()


def test_a_bf16_policy_is_served_from_a_cast_copy_and_stays_on_policy(tmp_path):
    policy_args = dict(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, dtype="bfloat16")
    from unirl_lightning.models.causal_lm import TinyCausalLM

    module = tiny_module(policy=TinyCausalLM(**policy_args))
    strategy = AsyncRolloutStrategy(**HYBRID)
    try:
        _, module, recorder = fit_tiny(tmp_path, max_steps=3, strategy=strategy, module=module)
        for step in recorder.steps[1:]:
            assert step["metrics"]["sync/bytes"] > 0  # float32 masters cast into the bf16 engine
        engine = strategy.runtime.workers.workers[0].engine
        for name, tensor in module.policy.state_dict().items():
            assert torch.equal(engine.model.state_dict()[name], tensor.to(torch.bfloat16)), name
        for step in recorder.steps:  # the trainer recomputes in bf16 what the engine sampled in bf16
            assert abs(step["metrics"]["train/ratio_mean"] - 1.0) < 1e-2
    finally:
        strategy.shutdown()


def test_group_launches_run_on_the_in_process_engine_on_policy(tmp_path):
    """``launch_unit="group"`` with ``placement="hybrid"``: the same group interface, each group
    generated in this process and reaped at once; every step trains ``batch_size`` groups on policy."""
    strategy = AsyncRolloutStrategy(**HYBRID, launch_unit="group")
    try:
        _, _, recorder = fit_tiny(tmp_path, max_steps=3, strategy=strategy)
        assert [len(step["gen_ids"]) for step in recorder.steps] == [4, 4, 4]
        assert_on_policy(recorder.steps)
    finally:
        strategy.shutdown()


def test_agentic_modules_refuse_hybrid_naming_placement():
    from types import SimpleNamespace

    from tests.builders import rollout_settings
    from unirl_lightning.runtime.agentic import AgenticRuntime

    runtime = AgenticRuntime(SimpleNamespace(family="token"), rollout_settings(**HYBRID), weight_sync=None)
    with pytest.raises(ValueError, match=r"placement='hybrid' is not available to agentic modules"):
        runtime.check()


def test_the_cli_refuses_a_ray_backend_with_hybrid_at_parse_time(tmp_path, capsys):
    from unirl_lightning.cli.app import run_cli

    with pytest.raises(SystemExit) as exc:
        run_cli(["--config", str(RECIPE), "--trainer.strategy.init_args.weight_sync=object_store"], run=False)
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert "placement='hybrid'" in err and "weight_sync='object_store'" in err


def test_the_cli_refuses_vllm_with_hybrid_on_two_ranks_at_parse_time(capsys):
    from unirl_lightning.cli.app import run_cli

    args = ["--trainer.devices=2", "--trainer.strategy.init_args.engine=vllm"]
    with pytest.raises(SystemExit) as exc:
        run_cli(["--config", str(RECIPE), *args], run=False)
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert "placement='hybrid' with engine='vllm'" in err and "got 2 training ranks" in err


def run_without_ray(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    return subprocess.run(
        [sys.executable, str(REPO / "tests" / "no_ray.py"), "-m", "unirl_lightning.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )


@pytest.mark.slow
def test_the_hybrid_recipe_learns_checkpoints_and_resumes_with_ray_blocked(tmp_path):
    """60 steps of examples/grpo_tiny_hybrid.yaml (it runs 120) in a process where ``import ray``
    fails: held-out accuracy goes up, every step is on-policy, and a resume from the last checkpoint
    goes on from its version; ``ray`` was never even asked for."""
    common = ["--config", str(RECIPE), "--trainer.enable_progress_bar=false"]
    first = run_without_ray(["fit", *common, "--trainer.max_steps=60"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "RAY_IMPORTS=0 " in first.stderr
    scalars = read_scalars(tmp_path / "runs" / "grpo_tiny_hybrid")
    accuracy = [v for _, v in scalars["eval/accuracy"]]
    print(f"held-out accuracy with ray blocked: {accuracy}")
    assert accuracy[-1] >= accuracy[0] + 0.15, f"no learning: held-out accuracy {accuracy}"
    assert all(abs(v - 1) < 1e-3 for _, v in scalars["train/ratio_mean"])
    assert max(v for _, v in scalars["train/logp_diff_abs"]) < 1e-4
    resumed = run_without_ray(["fit", *common, "--trainer.max_steps=63", "--ckpt_path=last"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "RAY_IMPORTS=0 " in resumed.stderr
    versions = read_scalars(tmp_path / "runs" / "grpo_tiny_hybrid")["rollout/weight_version"]
    after = [int(v) for s, v in versions if s > 60]  # the ledger goes on from the checkpoint's version
    assert after and min(after) >= 60 and max(after) == 63 and after == sorted(after), after


@pytest.mark.slow
@needs_smollm2
def test_smollm2_hybrid_is_on_policy(tmp_path):
    from tests.builders import StepRecorder, make_trainer
    from unirl_lightning.callbacks import WeightSyncCallback, WeightVersionLogger
    from unirl_lightning.data import PromptDataModule
    from unirl_lightning.models.causal_lm import PretrainedCausalLM
    from unirl_lightning.modules import GRPOModule
    from unirl_lightning.rewards import MathVerifyReward

    module = GRPOModule(
        policy=PretrainedCausalLM("smollm2-135m-instruct", dtype="float32", chat=True),
        reward=MathVerifyReward(),
        num_generations=2,
        max_new_tokens=24,
        lr=1e-6,
    )
    data = PromptDataModule(
        train="word_problems", batch_size=2, num_train_prompts=16, task_kwargs={"difficulty": "easy"}
    )
    strategy = AsyncRolloutStrategy(**HYBRID)
    recorder = StepRecorder()
    trainer = make_trainer(tmp_path, strategy, 3, [WeightSyncCallback(), WeightVersionLogger(), recorder])
    try:
        trainer.fit(module, datamodule=data)
        assert len(recorder.steps) == 3
        for step in recorder.steps:
            print(
                f"SmolLM2 hybrid: |ratio-1|={abs(step['metrics']['train/ratio_mean'] - 1):.2e} "
                f"logp gap={step['metrics']['train/logp_diff_abs']:.2e} sync bytes={step['metrics']['sync/bytes']:.0f}"
            )
        assert_on_policy(recorder.steps)
    finally:
        strategy.shutdown()


def test_the_package_the_modules_the_cli_and_the_hybrid_group_import_with_ray_blocked(tmp_path):
    """What a hybrid ``fit``, ``export`` and ``plan`` import, in a process where ``import ray`` fails;
    ``ray`` is not even asked for."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    code = (
        "import unirl_lightning, unirl_lightning.modules, unirl_lightning.callbacks, unirl_lightning.cli.app, "
        "unirl_lightning.models.export, unirl_lightning.planning.plan, unirl_lightning.workers, unirl_lightning.weight_sync\n"
        "from unirl_lightning.workers.factory import worker_group_class\n"
        "worker_group_class('hybrid')\n"
        "from unirl_lightning import AsyncRolloutStrategy, GRPOModule\n"
        "AsyncRolloutStrategy(placement='hybrid', max_staleness=0, max_inflight=1).shutdown()\n"
    )
    out = subprocess.run(
        [sys.executable, str(REPO / "tests" / "no_ray.py"), "-c", code],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RAY_IMPORTS=0 " in out.stderr
