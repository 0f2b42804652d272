"""LightningCLI parses real YAML: bad keys, types and impossible combinations fail at parse time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.parse_only import ParseOnlyCLI, init_args
from unirl_lightning.cli.app import UniRLCLI, run_cli

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny.yaml"


def write_recipe(tmp_path: Path, edit) -> Path:
    config = yaml.safe_load(RECIPE.read_text())
    edit(config)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def parse_error(capsys, path: Path) -> str:
    with pytest.raises(SystemExit) as exc:
        run_cli(["--config", str(path)], run=False)
    assert exc.value.code != 0
    return capsys.readouterr().err


def test_recipe_parses_and_builds_every_component(tmp_path):
    cli = run_cli(["--config", str(RECIPE), f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert type(cli.trainer.strategy).__name__ == "AsyncRolloutStrategy"
    assert cli.trainer.strategy.rollout.max_staleness == 1 and cli.trainer.strategy.rollout.max_inflight == 2
    assert type(cli.model).__name__ == "GRPOModule"
    assert {type(c).__name__ for c in cli.trainer.callbacks} >= {
        "WeightSyncCallback",
        "RolloutEvalCallback",
        "WeightVersionLogger",
    }


def test_unknown_key_fails_at_parse_time_naming_the_key(tmp_path, capsys):
    path = write_recipe(tmp_path, lambda c: c["model"]["init_args"].update(num_generatoins=8))
    assert "num_generatoins" in parse_error(capsys, path)


def test_wrong_type_fails_at_parse_time_naming_the_key(tmp_path, capsys):
    path = write_recipe(tmp_path, lambda c: c["model"]["init_args"].update(lr="fast"))
    err = parse_error(capsys, path)
    assert "lr" in err and "fast" in err


def test_max_inflight_zero_fails_at_parse_time_naming_the_key(tmp_path, capsys):
    path = write_recipe(tmp_path, lambda c: c["trainer"]["strategy"]["init_args"].update(max_inflight=0))
    err = parse_error(capsys, path)
    assert "max_inflight" in err


def test_colocate_with_async_settings_is_rejected_before_instantiation(tmp_path, capsys):
    path = write_recipe(
        tmp_path, lambda c: c["trainer"]["strategy"]["init_args"].update(placement="colocate")
    )
    err = parse_error(capsys, path)
    assert "trainer.strategy.init_args: placement='colocate'" in err
    assert "needs max_staleness=0 and max_inflight=1" in err


class WrongCount:  # importable, but a class: not a reward function
    pass


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ("nope", "model.init_args.reward: cannot import 'nope'"),
        ("no_such_module_xyz:f", "model.init_args.reward: cannot import 'no_such_module_xyz:f'"),
        (
            "tests.integration.test_cli:WrongCount",
            "model.init_args.reward: 'tests.integration.test_cli:WrongCount' is a class",
        ),
    ],
)
def test_a_reward_path_that_does_not_import_fails_at_parse_time_naming_the_key(
    tmp_path, capsys, reward, message
):
    path = write_recipe(tmp_path, lambda c: c["model"]["init_args"].update(reward=reward))
    assert message in parse_error(capsys, path)


def test_a_bad_choice_fails_at_parse_time_naming_the_key_whatever_the_other_settings(tmp_path, capsys):
    path = write_recipe(tmp_path, lambda c: c["model"]["init_args"].update(kl_estimator="k9", kl_coef=0.0))
    err = parse_error(capsys, path)
    assert 'Parser key "kl_estimator"' in err and "k9" in err


def test_ckpt_path_last_without_a_checkpoint_fails_naming_where_it_looked(tmp_path, capsys):
    args = ["fit", "--config", str(RECIPE), f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}"]
    with pytest.raises(SystemExit) as exc:
        run_cli([*args, "--ckpt_path=last"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "ckpt_path: 'last' was given but there is no last*.ckpt in" in err
    assert str(tmp_path / "runs" / "grpo_tiny") in err


def test_strategy_is_registered_by_name():
    from lightning.pytorch.strategies import StrategyRegistry

    import unirl_lightning.strategy  # noqa: F401

    assert "async_rollout" in StrategyRegistry


def test_print_config_shows_every_knob():
    out = subprocess.run(
        [sys.executable, "-m", "unirl_lightning.cli", "fit", "--config", str(RECIPE), "--print_config"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    printed = yaml.safe_load(out.stdout)
    assert printed["trainer"]["strategy"]["init_args"]["max_staleness"] == 1
    assert printed["model"]["init_args"]["clip_high"] == 0.2
    assert UniRLCLI.__name__  # the console script class is importable


def test_gpu_grpo_recipe_parses_naming_a_hub_model():
    """GPU recipes name hub models, so they are only parsed here (nothing is instantiated)."""
    config = ParseOnlyCLI(
        args=["--config", str(RECIPE.parent / "grpo_qwen2.5_0.5b_gsm8k.yaml")], run=False
    ).config
    policy = init_args(config.model.init_args.policy)
    assert policy.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert config.trainer.strategy.init_args.weight_sync == "collective"


def test_the_same_recipe_is_served_by_another_engine_with_a_strategy_change_only():
    hf = ParseOnlyCLI(args=["--config", str(RECIPE)], run=False).config
    vllm = ParseOnlyCLI(
        args=["--config", str(RECIPE), "--trainer.strategy.init_args.engine=vllm"], run=False
    ).config
    assert hf.trainer.strategy.init_args.engine == "hf" and vllm.trainer.strategy.init_args.engine == "vllm"
    assert hf.model == vllm.model, "changing the engine must not touch the model section"


def test_the_ddp_fsdp_and_real_model_recipes_parse():
    ddp = ParseOnlyCLI(args=["--config", str(RECIPE.parent / "grpo_tiny_ddp.yaml")], run=False).config
    assert ddp.trainer.strategy.class_path == "unirl_lightning.strategy.AsyncRolloutDDPStrategy"
    assert ddp.trainer.devices == 2 and ddp.trainer.strategy.init_args.num_workers == 1
    fsdp = ParseOnlyCLI(args=["--config", str(RECIPE.parent / "grpo_tiny_fsdp.yaml")], run=False).config
    assert fsdp.trainer.strategy.class_path == "unirl_lightning.strategy.AsyncRolloutFSDPStrategy"
    assert fsdp.model == ddp.model, "the FSDP recipe trains the DDP recipe's model"
    gpu = ParseOnlyCLI(
        args=["--config", str(RECIPE.parent / "grpo_qwen2.5_7b_fsdp_vllm.yaml")], run=False
    ).config
    strategy = gpu.trainer.strategy.init_args
    assert strategy.process_group_backend == "nccl" and strategy.save_distributed_checkpoint is True
    assert init_args(strategy.engine).gpu_memory_utilization == 0.85 and gpu.trainer.devices == 4
    smol = ParseOnlyCLI(args=["--config", str(RECIPE.parent / "grpo_smollm2_cpu.yaml")], run=False).config
    policy = init_args(smol.model.init_args.policy)
    assert policy.name_or_path == "smollm2-135m-instruct" and policy.chat is True
    assert smol.data.init_args.held_out == "disjoint"
