"""``unirl-lightning plan``: every shipped recipe plans clean at the cluster its header names; the 7B
recipe's two launch failures (collective sync with worker restarts under FSDP, activations that do
not fit) are found without building anything; and planning imports no Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from unirl_lightning.cli.app import PlanCLI, run_plan
from unirl_lightning.cli.recipes import header_cluster
from unirl_lightning.core.preflight import fused_optimizer_allowed, sync_replacement_error
from unirl_lightning.planning.plan import ModelShape, parse_cluster, plan_recipe

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
SEVEN_B = str(REPO / "examples" / "grpo_qwen2.5_7b_fsdp_vllm.yaml")


@pytest.mark.parametrize("recipe", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_names_its_cluster_and_plans_clean(recipe, capsys):
    cluster = header_cluster([str(recipe)])
    assert cluster is not None, f"{recipe.name} has no '# cluster:' header line"
    parse_cluster(cluster)
    result = run_plan(["--config", str(recipe)])
    assert result["ok"], result["findings"]
    assert not [f for f in result["findings"] if f["level"] == "warning"], result["findings"]
    assert f"plan on {cluster}: OK" in capsys.readouterr().out


def test_the_7b_recipe_plans_per_gpu_memory_for_trainers_and_vllm_workers(tmp_path):
    output = tmp_path / "plan.json"
    result = run_plan(["--config", SEVEN_B, "--cluster", "1x8x80", "--output", str(output)])
    assert json.loads(output.read_text()) == result
    training, worker = result["figures"]["training_gpu"], result["figures"]["vllm_worker_gpu"]
    assert training["gradient_checkpointing"] and training["micro_batch_tokens"] == 8192
    assert 20 < training["total_gib"] < 80  # fp32 states of 7.6B params over 4 ranks alone are 28 GiB
    assert 14 < worker["weights_gib"] < 15 and worker["kv_tokens"] > worker["tokens_needed"]
    assert result["figures"]["placement"] == {
        "training_gpus": 4,
        "workers": 4,
        "worker_gpus": 4.0,
        "cluster_gpus": 8,
    }


def test_without_checkpointing_and_micro_batches_the_7b_recipe_fails_naming_the_memory(capsys):
    args = [
        "--config",
        SEVEN_B,
        "--model.init_args.gradient_checkpointing=false",
        "--model.init_args.micro_batch_tokens=null",
    ]
    with pytest.raises(SystemExit) as exit_info:
        run_plan(args)
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert "FAILS" in out and "error   model.init_args.gradient_checkpointing" in out
    assert "a training GPU needs about" in out and "of its 80 GiB" in out


def test_collective_sync_with_worker_restarts_under_fsdp_fails_naming_max_worker_restarts(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_plan(["--config", SEVEN_B, "--trainer.strategy.init_args.max_worker_restarts=3"])
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert "trainer.strategy.init_args.max_worker_restarts" in out and "(got 3)" in out
    assert out.count("cannot feed a replaced rollout worker") == 1  # one finding, not one per check


def test_fit_refuses_the_same_combination_at_parse_time_with_the_same_rule():
    from unirl_lightning.cli.app import run_cli

    with pytest.raises(SystemExit) as exit_info:
        run_cli(["fit", "--config", SEVEN_B, "--trainer.strategy.init_args.max_worker_restarts=3"])
    assert exit_info.value.code == 2


def test_the_rules_are_pure_functions_of_the_settings():
    assert sync_replacement_error("collective", sharded=True, world_size=4, max_worker_restarts=3)
    assert sync_replacement_error("collective", sharded=True, world_size=4, max_worker_restarts=0) is None
    assert sync_replacement_error("object_store", sharded=True, world_size=4, max_worker_restarts=3) is None
    assert sync_replacement_error("collective", sharded=False, world_size=4, max_worker_restarts=3) is None
    assert sync_replacement_error("collective", sharded=True, world_size=1, max_worker_restarts=3) is None
    assert not fused_optimizer_allowed("bf16-mixed") and not fused_optimizer_allowed("16-mixed")
    assert fused_optimizer_allowed("32-true") and fused_optimizer_allowed(None)


def test_a_bad_cluster_names_the_form():
    with pytest.raises(ValueError, match=r"cluster: expected NODESxGPUSxGIB .* got '8 GPUs'"):
        parse_cluster("8 GPUs")
    assert parse_cluster("2x8x80").nodes == 2 and parse_cluster("cpu").cpu


def test_the_model_shape_counts_qwen_7b_parameters():
    shape = ModelShape.from_dir(REPO / "examples" / "model_configs" / "Qwen2.5-7B-Instruct")
    assert 7.5e9 < shape.params < 7.7e9  # the model card: 7.61B
    assert shape.has_chat_template


def test_an_instruct_model_prompted_without_its_chat_template_is_a_warning():
    shape = ModelShape.from_dir(REPO / "examples" / "model_configs" / "Qwen2.5-0.5B-Instruct")
    config = {
        "trainer": {"precision": "32-true"},
        "model": {
            "init_args": {
                "policy": {
                    "class_path": "unirl_lightning.models.causal_lm.PretrainedCausalLM",
                    "init_args": {"name_or_path": "Qwen/Qwen2.5-0.5B-Instruct", "chat": False},
                }
            }
        },
    }
    result = plan_recipe(config, parse_cluster("cpu"), shape)
    assert [f["key"] for f in result["findings"]] == ["model.init_args.policy.init_args.chat"]
    assert result["ok"]  # a warning, not an error


def test_group_launches_with_max_inflight_below_the_window_are_a_warning():
    """The warning fit gives at its start, found from the YAML: the cadence comes from the recipe's
    WeightSyncCallback."""
    strategy = {"init_args": {"launch_unit": "group", "max_staleness": 1, "max_inflight": 2}}
    sync = {"class_path": "unirl_lightning.callbacks.WeightSyncCallback", "init_args": {"every_n_steps": 2}}
    config = {"trainer": {"strategy": strategy, "callbacks": [sync]}}
    result = plan_recipe(config, parse_cluster("cpu"), None)
    (finding,) = result["findings"]
    assert finding["key"] == "trainer.strategy.init_args.max_inflight" and finding["level"] == "warning"
    assert finding["message"].endswith("set max_inflight: 4") and result["ok"]
    sync["init_args"]["every_n_steps"] = 1
    assert plan_recipe(config, parse_cluster("cpu"), None)["findings"] == []


def test_plan_imports_no_ray(tmp_path):
    fake = tmp_path / "ray"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('ray is not installed here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-m", "unirl_lightning.cli", "plan", "--config", SEVEN_B],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "plan on 1x8x80: OK" in done.stdout


def test_plan_builds_nothing(monkeypatch):
    import unirl_lightning.models.causal_lm as models

    def refuse(*args, **kwargs):
        raise AssertionError("plan built a model")

    monkeypatch.setattr(models.PretrainedCausalLM, "build", refuse)
    cli = PlanCLI(args=["--config", SEVEN_B])
    assert cli.model is None and cli.trainer is None


def test_the_strategy_checks_the_rule_on_every_rank_before_any_worker_starts():
    from unirl_lightning.strategy import AsyncRolloutDDPStrategy, AsyncRolloutFSDPStrategy

    strategy = AsyncRolloutFSDPStrategy(weight_sync="collective", max_worker_restarts=3)
    with pytest.raises(ValueError, match=r"max_worker_restarts=0 \(got 3\)"):
        strategy.preflight(world_size=4)
    assert strategy.runtime is None
    AsyncRolloutFSDPStrategy(weight_sync="collective", max_worker_restarts=0).preflight(world_size=4)
    AsyncRolloutDDPStrategy(weight_sync="collective", max_worker_restarts=3).preflight(world_size=4)


def test_plan_counts_the_reward_workers_gpus_and_names_reward_workers_when_they_do_not_fit(capsys):
    recipe = str(REPO / "examples" / "grpo_tiny_reward_model.yaml")
    args = ["--config", recipe, "--trainer.devices=1", "--trainer.strategy.init_args.num_gpus_per_worker=1"]
    args += ["--trainer.strategy.init_args.reward_workers.num_gpus_per_worker=1"]
    result = run_plan([*args, "--cluster", "1x3x80"])
    assert result["ok"], result["findings"]
    assert result["figures"]["placement"] == {
        "training_gpus": 1,
        "workers": 1,
        "worker_gpus": 1.0,
        "reward_workers": 1,
        "reward_worker_gpus": 1.0,
        "cluster_gpus": 3,
    }
    with pytest.raises(SystemExit):
        run_plan([*args, "--cluster", "1x2x80"])
    out = capsys.readouterr().out
    assert "error   trainer.strategy.init_args.reward_workers" in out
    assert "+ 1 reward workers x 1 GPUs = 3 GPUs, more than the cluster's 2" in out


def test_a_model_config_folder_without_config_json_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_plan(["--config", SEVEN_B, "--cluster", "1x8x80", "--model_config", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"--model_config {tmp_path}: no config.json there" in capsys.readouterr().err
