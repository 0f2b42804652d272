"""Wrong configs end with exit code 2 and a last line that names the key and what is allowed: range
checks of the modules, the data module and the strategy (run at instantiation, before ``fit``), type
errors, misspelled keys (with a did-you-mean), an unknown ``class_path`` (with the classes there), an
unknown engine (with the engines), and a missing data file (before any run folder is made)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unirl_lightning.cli.app import run_cli

RECIPE = str(Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny.yaml")


def _engine(class_name: str, **init_args: object) -> str:
    """The command-line argument that sets the strategy's engine to ``class_name`` (under
    ``unirl_lightning.engines``) with ``init_args``."""
    spec = {"class_path": f"unirl_lightning.engines.{class_name}", "init_args": init_args}
    return f"--trainer.strategy.init_args.engine={json.dumps(spec)}"


CASES = [
    ("--model.init_args.num_generations=-4", "model.init_args.num_generations must be >= 1, got -4"),
    ("--model.init_args.lr=-0.003", "model.init_args.lr must be >= 0, got -0.003"),
    (
        "--data.init_args.batch_size=-16",
        "data.init_args.batch_size: PromptDataModule batch_size=-16 is invalid",
    ),
    ("--model.init_args.lr=fast", "model.init_args.lr: Expected a <class 'float'>. Got value: fast"),
    ("--model.init_args.num_generation=4", "did you mean 'num_generations'?"),
    ("--model.class_path=unirl_lightning.modules.GRPOModul", "did you mean 'GRPOModule'? Classes there:"),
    (
        "--trainer.strategy.init_args.engine=vlm",
        "engine: expected one of ['auto', 'hf', 'vllm', 'sglang', 'diffusion']",
    ),
    (
        "--model.init_args.loss=ppx",
        "model.init_args.loss: Expected a typing.Literal['ppo', 'cispo']. Got value: ppx",
    ),
    (
        "--model.init_args.loss=cispo",
        "model.init_args.clip_ratio_c (dual-clip) is defined for loss='ppo' only",
    ),
    ("--model.init_args.tis_cap=2.0", "model.init_args.tis_cap needs old_logprob='recompute'"),
    (
        "--trainer.strategy.init_args.max_staleness=-1",
        "trainer.strategy.init_args.max_staleness: Not of type NonNegativeInt",
    ),
    ("--model.init_args.warmup_steps=-1", "model.init_args.warmup_steps must be >= 0, got -1"),
    (
        "--data.init_args.max_prompt_length=0",
        "data.init_args.max_prompt_length: PromptDataModule max_prompt_length=0 is invalid",
    ),
    (
        "--model.init_args.lr_schedule=cos",
        "model.init_args.lr_schedule: Expected a typing.Literal['constant', 'linear', 'cosine']",
    ),
    (
        "--data.init_args.train=missing.jsonl",
        "data.init_args.train: prompt source 'missing.jsonl' is not an existing file",
    ),
    (
        "--model.init_args.temperature=0",
        "model.init_args.temperature must be > 0 for training rollouts, got 0.0",
    ),
    ("--model.init_args.clip_low=1.5", "model.init_args.clip_low must be in [0, 1), got 1.5"),
    (
        "--trainer.strategy.init_args.abort_timeout_s=0",
        "trainer.strategy.init_args.abort_timeout_s must be > 0, got 0",
    ),
    # an engine given as a class_path: its fields are type-checked like the strategy's own
    (
        _engine("hf.HFEngineConfig", share_prompt_prefill="maybe"),
        "trainer.strategy.init_args.engine.init_args.share_prompt_prefill: Expected a <class 'bool'>. "
        "Got value: maybe",
    ),
    (
        _engine("hf.HFEngineConfig", batching="dynamic"),
        "trainer.strategy.init_args.engine.init_args.batching: Expected a typing.Literal['static', 'continuous']",
    ),
    (
        "--trainer.strategy.init_args.sync_mode=continue",
        "trainer.strategy.init_args: sync_mode='continue' pushes weights while generation goes on, and the "
        "engine 'hf' does not load between decode steps",
    ),
    (
        _engine("vllm.VLLMEngineConfig", gpu_memory_utilization="high"),
        "trainer.strategy.init_args.engine.init_args.gpu_memory_utilization: Expected a <class 'float'>",
    ),
    (
        _engine("sglang.SGLangEngineConfig", tp_sise=2),
        "trainer.strategy.init_args.engine.init_args.tp_sise: SGLangEngineConfig has no setting "
        "'tp_sise'; did you mean 'tp_size'?",
    ),
]


@pytest.mark.parametrize(
    ("arg", "last_line"), CASES, ids=[c[0].split("=")[0].rsplit(".", 1)[-1] for c in CASES]
)
def test_a_wrong_config_exits_2_with_a_last_line_naming_the_key(
    arg, last_line, capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # a run folder, if one were made, would land here
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["fit", "--config", RECIPE, arg])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line in last, last
    assert not any(tmp_path.iterdir()), "a folder was made before the config was refused"


def test_the_console_script_lists_every_verb(capsys):
    from unirl_lightning.cli.verbs import main

    main(["--help"])
    out = capsys.readouterr().out
    for verb in ("fit", "plan", "validate", "export"):
        assert f"\n  {verb} " in out
    assert "--model.help GRPOModule" in out


def test_every_grpo_setting_has_its_own_text_in_the_modules_help(capsys):
    """``fit --model.help GRPOModule`` shows each argument with text of its own (no combined docstring
    entry left that the help would show bare)."""
    import re

    from unirl_lightning.cli.errors import _init_keywords

    with pytest.raises(SystemExit):
        run_cli(["fit", "--model.help", "GRPOModule"])
    out = capsys.readouterr().out
    bare = []
    for key in _init_keywords("unirl_lightning.modules.GRPOModule"):
        entry = re.search(rf"^  --model\.{key}\b.*?(?=^  --|\Z)", out, re.M | re.S)
        text = re.sub(rf"^  --model\.{key}( \S+)?", "", entry.group(0) if entry else "").strip()
        if not text or text.startswith("(type:"):
            bare.append(key)
    assert bare == [], bare


def test_fit_help_ends_with_where_the_rl_settings_are_and_each_named_help_works(capsys):
    """``fit --help`` names a ``--X.help CLASS`` for the module, the strategy, the data and the
    evaluation; each of them prints that class's settings (exit 0)."""
    import re

    from unirl_lightning.cli.app import FIT_SETTINGS_HELP

    with pytest.raises(SystemExit) as exit_info:
        run_cli(["fit", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert " ".join(FIT_SETTINGS_HELP.split()) in out
    named = re.findall(r"(--[\w.]+\.help) ([\w.]*\w)", FIT_SETTINGS_HELP)
    assert [flag for flag, _ in named] == [
        "--model.help",
        "--trainer.strategy.help",
        "--data.help",
        "--trainer.callbacks.help",
    ]
    for flag, cls in named:
        with pytest.raises(SystemExit) as exit_info:
            run_cli(["fit", flag, cls])
        assert exit_info.value.code == 0, (flag, cls)
        printed = capsys.readouterr().out
        assert f"Help for {flag}=" in printed and printed.count(f"  {flag.removesuffix('help')}") >= 3, (
            flag,
            cls,
        )
