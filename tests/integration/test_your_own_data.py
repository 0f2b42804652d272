"""docs/your_own_data.md, run as written: a JSON-lines file with columns of its own, a reward function in
a file, then ``fit``, ``validate`` and ``export`` through the ``unirl-lightning`` entry point."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

from unirl_lightning.cli.verbs import main
from unirl_lightning.data.sources import load_records

pytestmark = pytest.mark.slow

REWARD = '''def score(completions, target, **kwargs):
    """1.0 when the completion starts with the target digit."""
    return [1.0 if c.strip().startswith(str(t)) else 0.0 for c, t in zip(completions, target)]
'''
MINE = """model:
  init_args:
    reward: my_reward.py:score
data:
  init_args:
    train: train.jsonl
    val: val.jsonl
    prompt_key: q
    answer_key: target
"""


def test_a_file_of_your_own_and_a_reward_function_fit_validate_and_export(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rows = load_records("digit_successor", num_prompts=200, seed=0, task_kwargs={"prefix_len": 2})
    for name, part in (("train.jsonl", rows[:160]), ("val.jsonl", rows[160:])):
        (tmp_path / name).write_text(
            "".join(json.dumps({"q": r["prompt"], "target": r["answer"]}) + "\n" for r in part)
        )
    (tmp_path / "my_reward.py").write_text(REWARD)
    (tmp_path / "mine.yaml").write_text(MINE)
    recipe = ["--config", "grpo_tiny_hybrid", "--config", "mine.yaml"]

    main(["fit", *recipe, "--trainer.max_steps", "4", "--trainer.enable_progress_bar", "false"])
    assert list(tmp_path.rglob("last.ckpt"))
    capsys.readouterr()
    main(["validate", *recipe, "--ckpt_path", "last"])
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0.0 <= figures["eval/accuracy"] <= 1.0 and "eval/reward/score_mean" in figures  # the file's reward
    main(["export", *recipe, "--ckpt_path", "last", "--output", "my_model"])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "my_model")
    assert sum(p.numel() for p in model.parameters()) > 0
