"""A user's own data and the flags a Lightning user types: each mistake ends with exit code 2 before
anything is built, and a last line that names the key (and the file's line) and what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from unirl_lightning.cli.app import run_cli
from unirl_lightning.cli.verbs import main

RECIPE = str(Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny.yaml")


def rows(n: int) -> str:
    return "".join(json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(n))


def refused(args: list[str], capsys, entry=run_cli) -> str:
    with pytest.raises(SystemExit) as exit_info:
        entry(args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture
def own_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a run folder, if one were made, would land here
    return tmp_path


def test_a_malformed_line_is_named_by_file_and_line(own_data, capsys):
    (own_data / "mine.jsonl").write_text(rows(20) + '{"question": "bad\n' + rows(2))
    last = refused(
        ["fit", "--config", RECIPE, "--data.train=mine.jsonl", "--data.prompt_key=question"], capsys
    )
    assert "data.init_args.train: mine.jsonl:21 is not a JSON object" in last, last
    (own_data / "list.jsonl").write_text(rows(20) + "[1, 2]\n")
    last = refused(
        ["fit", "--config", RECIPE, "--data.train=list.jsonl", "--data.prompt_key=question"], capsys
    )
    assert "list.jsonl:21 is not a JSON object: a JSON list" in last, last
    assert not (own_data / "runs").exists()


def test_fewer_rows_than_batch_size_are_refused_naming_both(own_data, capsys):
    (own_data / "few.jsonl").write_text(rows(5))
    args = [
        "fit",
        "--config",
        RECIPE,
        "--data.train=few.jsonl",
        "--data.prompt_key=question",
        "--data.val=few.jsonl",
    ]
    last = refused(args, capsys)
    assert "few.jsonl has 5 rows, fewer than data.init_args.batch_size=16" in last, last


def test_an_evaluation_without_held_out_prompts_is_refused_naming_the_keys(own_data, capsys):
    (own_data / "mine.jsonl").write_text(rows(40))
    args = ["fit", "--config", RECIPE, "--data.train=mine.jsonl", "--data.prompt_key=question"]
    last = refused(args, capsys)
    assert (
        "(RolloutEvalCallback) evaluates held-out prompts" in last and "data.init_args.val_split" in last
    ), last
    # what the message says works: parse and build pass (one step runs the evaluation on val's prompts)
    (own_data / "val.jsonl").write_text(rows(8))
    cli = run_cli(
        [*args, "--data.val=val.jsonl", "--trainer.max_steps=1", "--trainer.enable_progress_bar=false"]
    )
    assert cli.trainer.global_step >= 1


def test_gradient_accumulation_is_refused_naming_the_micro_batches(own_data, capsys):
    last = refused(["fit", "--config", RECIPE, "--trainer.accumulate_grad_batches=4"], capsys)
    assert last.startswith("error: trainer.accumulate_grad_batches=4") and "micro_batch_rows" in last, last


def test_an_unknown_verb_lists_every_verb(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fitt", "--config", RECIPE])
    assert exit_info.value.code == 2
    usage, last = capsys.readouterr().err.strip().splitlines()[-2:]
    assert usage.startswith("usage: unirl-lightning {fit,plan,validate,export,demo,recipes,test,predict}")
    assert last.endswith("did you mean 'fit'?"), last


def test_empty_prompts_and_rows_without_their_answer_are_dropped_and_counted(own_data, caplog):
    from unirl_lightning.data import PromptDataModule

    lines = [{"question": f"{i}+1?", "answer": i + 1} for i in range(40)]  # int answers stay ints
    lines[3]["question"] = "  "
    lines[5]["answer"] = None
    del lines[7]["answer"]
    (own_data / "mine.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    data = PromptDataModule(train="mine.jsonl", prompt_key="question", val="mine.jsonl", batch_size=4)
    data.setup()
    records = data.train_records()
    assert len(records) == 37 and data.dropped_prompts == {
        "empty/train": 1,
        "no_answer/train": 2,
        "empty/val": 1,
        "no_answer/val": 2,
    }
    assert all(r["prompt"].strip() and r["answer"] is not None for r in records)
    assert records[0]["answer"] == 1  # a reward gets the answer as the file holds it
    assert "1 with an empty prompt, 2 without their answer" in caplog.text
    kept = PromptDataModule(train="mine.jsonl", prompt_key="question", answer_key=None, batch_size=4)
    kept.setup()
    assert len(kept.train_records()) == 39  # answer_key=None: no answer is read, only the empty prompt goes


def test_a_malformed_parquet_row_is_named_by_its_row_index(own_data, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    questions = [f"{i}+1?" for i in range(30)]
    questions[12] = None
    pq.write_table(
        pa.table({"question": questions, "answer": [str(i) for i in range(30)]}), own_data / "mine.parquet"
    )
    args = [
        "fit",
        "--config",
        RECIPE,
        "--data.train=mine.parquet",
        "--data.prompt_key=question",
        "--data.val=mine.parquet",
    ]
    last = refused(args, capsys)
    assert "mine.parquet, row 13 (of the table, from 1): its 'question' holds NoneType None" in last, last
