"""Pins unirl_lightning.data: built-in task answers, file loading, PromptDataModule batching and errors."""

from __future__ import annotations

import json
import re

import pytest

from unirl_lightning.data import BUILTIN_TASKS, PromptDataModule, load_records, make_task
from unirl_lightning.data.datamodule import VAL_SEED_OFFSET

TASK_VOCABULARY = set("0123456789+= ")


def write_jsonl(path, rows, raw_lines=()):
    lines = [json.dumps(row) for row in rows] + list(raw_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------- built-in tasks


def test_digit_successor_answers_are_next_digit_mod_10_including_wraparound():
    records = make_task("digit_successor", num_prompts=200, seed=0)
    pairs = {record["prompt"]: record["answer"] for record in records}
    # Hand-checked; 200 draws from 10 prompts contain all of them.
    assert pairs == {f"{d}=": str((d + 1) % 10) for d in range(10)}
    assert pairs["9="] == "0" and pairs["3="] == "4"


def test_digit_successor_prefix_len_prepends_random_digits_and_space():
    records = make_task("digit_successor", num_prompts=50, seed=1, prefix_len=2)
    assert make_task("digit_successor", num_prompts=1, seed=3, prefix_len=2) == [
        {"prompt": "39 8=", "answer": "9", "task": "digit_successor"}
    ]
    for record in records:
        match = re.fullmatch(r"\d\d (\d)=", record["prompt"])
        assert match, record
        assert record["answer"] == str((int(match.group(1)) + 1) % 10)


def test_copy_first_answer_is_first_digit_of_length_digits():
    assert make_task("copy_first", num_prompts=2, seed=0) == [
        {"prompt": "660=", "answer": "6", "task": "copy_first"},
        {"prompt": "487=", "answer": "4", "task": "copy_first"},
    ]
    for record in make_task("copy_first", num_prompts=20, seed=5, length=5):
        assert re.fullmatch(r"\d{5}=", record["prompt"]) and record["answer"] == record["prompt"][0]


def test_add_mod10_answer_is_sum_mod_10():
    assert make_task("add_mod10", num_prompts=2, seed=0) == [
        {"prompt": "6+6=", "answer": "2", "task": "add_mod10"},
        {"prompt": "0+4=", "answer": "4", "task": "add_mod10"},
    ]
    for record in make_task("add_mod10", num_prompts=50, seed=2):
        a, b = re.fullmatch(r"(\d)\+(\d)=", record["prompt"]).groups()
        assert record["answer"] == str((int(a) + int(b)) % 10)


@pytest.mark.parametrize("name", sorted(BUILTIN_TASKS))
def test_tasks_are_deterministic_per_seed_and_use_the_small_vocabulary(name):
    first = make_task(name, num_prompts=30, seed=7)
    assert first == make_task(name, num_prompts=30, seed=7)
    assert first != make_task(name, num_prompts=30, seed=8)
    assert len(first) == 30
    assert all(set(record["prompt"]) <= TASK_VOCABULARY for record in first)
    assert all(len(record["answer"]) == 1 and record["answer"].isdigit() for record in first)


def test_unknown_task_lists_builtin_names():
    with pytest.raises(ValueError, match=r"'mult'.*\['add_mod10', 'copy_first', 'digit_successor'\]"):
        make_task("mult", num_prompts=1, seed=0)


def test_unknown_or_invalid_task_kwargs_are_rejected_with_allowed_values():
    with pytest.raises(
        ValueError, match=r"'add_mod10' got unknown keyword arguments \['length'\]; allowed: \[\]"
    ):
        make_task("add_mod10", num_prompts=1, seed=0, length=3)
    with pytest.raises(ValueError, match=r"length=0 is invalid; expected an int >= 1"):
        make_task("copy_first", num_prompts=1, seed=0, length=0)
    with pytest.raises(ValueError, match=r"num_prompts=-1 is invalid"):
        make_task("copy_first", num_prompts=-1, seed=0)


# ---------------------------------------------------------------- files


def test_jsonl_records_are_normalised_to_prompt_answer_and_keep_other_keys(tmp_path):
    path = write_jsonl(
        tmp_path / "qa.jsonl",
        [{"question": "1+1=", "solution": "2", "level": 1}, {"question": "2+2=", "solution": 4}],
        raw_lines=[""],
    )
    records = load_records(path, prompt_key="question", answer_key="solution")
    assert records == [
        {"question": "1+1=", "solution": "2", "level": 1, "prompt": "1+1=", "answer": "2"},
        {"question": "2+2=", "solution": 4, "prompt": "2+2=", "answer": 4},
    ]


def test_parquet_records_are_read_and_normalised(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "qa.parquet"
    pq.write_table(pa.table({"prompt": ["3+4=", "5+5="], "answer": ["7", "0"], "id": [10, 11]}), path)
    assert load_records(str(path)) == [
        {"prompt": "3+4=", "answer": "7", "id": 10},
        {"prompt": "5+5=", "answer": "0", "id": 11},
    ]


def test_record_missing_prompt_key_names_key_line_and_file(tmp_path):
    path = write_jsonl(
        tmp_path / "bad.jsonl", [{"prompt": "a", "answer": "1"}] * 2 + [{"text": "b", "answer": "2"}]
    )
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(path))}, line 3: record has no prompt key 'prompt'"
    ):
        load_records(path)


def test_record_missing_answer_key_is_an_error_unless_answer_key_is_none(tmp_path):
    path = write_jsonl(tmp_path / "open.jsonl", [{"prompt": "write a poem"}])
    with pytest.raises(ValueError, match=r"line 1: record has no answer key 'answer'"):
        load_records(path)
    assert load_records(path, answer_key=None) == [{"prompt": "write a poem"}]


def test_invalid_json_and_non_string_prompt_name_the_line(tmp_path):
    broken = write_jsonl(tmp_path / "broken.jsonl", [{"prompt": "a", "answer": "1"}], raw_lines=["{not json"])
    with pytest.raises(ValueError, match=r"broken.jsonl, line 2: invalid JSON"):
        load_records(broken)
    numeric = write_jsonl(tmp_path / "numeric.jsonl", [{"prompt": 5, "answer": "1"}])
    with pytest.raises(ValueError, match=r"line 1: prompt key 'prompt' holds int 5; expected a str"):
        load_records(numeric)


def test_missing_file_names_path_and_builtin_tasks(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=r"nope.jsonl.*built-in tasks: \['add_mod10', 'copy_first'"):
        load_records(str(missing))


def test_unsupported_suffix_and_empty_file_are_rejected(tmp_path):
    csv = tmp_path / "data.csv"
    csv.write_text("prompt,answer\n")
    with pytest.raises(ValueError, match=r"suffix '.csv'; supported: \['.jsonl', '.parquet'\]"):
        load_records(csv)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"contains no records"):
        load_records(empty)


# ---------------------------------------------------------------- PromptDataModule


def test_train_batches_are_lists_of_batch_size_record_dicts():
    data = PromptDataModule("add_mod10", batch_size=4, num_train_prompts=10)
    data.setup("fit")
    batches = list(data.train_dataloader())
    assert len(batches) == 2  # 10 // 4, the partial batch is dropped
    for batch in batches:
        assert isinstance(batch, list) and len(batch) == 4
        assert all(isinstance(record, dict) and set(record) >= {"prompt", "answer"} for record in batch)


def test_shuffle_is_deterministic_from_seed_and_unshuffled_keeps_file_order(tmp_path):
    def first_epoch(**kwargs):
        data = PromptDataModule("add_mod10", batch_size=2, num_train_prompts=16, **kwargs)
        return [record["prompt"] for batch in data.train_dataloader() for record in batch]

    records = make_task("add_mod10", num_prompts=16, seed=0)
    assert first_epoch(shuffle=False) == [record["prompt"] for record in records]
    assert first_epoch(seed=0) == first_epoch(seed=0)
    assert sorted(first_epoch(seed=0)) == sorted(record["prompt"] for record in records)


def test_epochs_restart_with_a_new_order_over_the_same_records():
    loader = PromptDataModule("copy_first", batch_size=4, num_train_prompts=32).train_dataloader()
    epoch_one = [record["prompt"] for batch in loader for record in batch]
    epoch_two = [record["prompt"] for batch in loader for record in batch]
    assert epoch_one != epoch_two and sorted(epoch_one) == sorted(epoch_two)


def test_builtin_val_defaults_to_same_task_with_another_seed():
    data = PromptDataModule("copy_first", batch_size=4, num_train_prompts=8, num_val_prompts=6, seed=3)
    held_out = data.val_records()
    assert held_out == make_task("copy_first", num_prompts=6, seed=3 + VAL_SEED_OFFSET)
    assert held_out != make_task("copy_first", num_prompts=6, seed=3)
    assert [len(batch) for batch in data.val_dataloader()] == [4, 2]  # validation keeps the partial batch


def test_task_kwargs_reach_both_train_and_val_tasks():
    data = PromptDataModule(
        "digit_successor", batch_size=2, num_train_prompts=4, task_kwargs={"prefix_len": 3}
    )
    for record in data.train_records() + data.val_records():
        assert re.fullmatch(r"\d{3} \d=", record["prompt"])


def test_file_train_and_file_val_with_custom_keys(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"q": f"{i}=", "a": str(i)} for i in range(6)])
    val = write_jsonl(tmp_path / "val.jsonl", [{"q": "9=", "a": "0"}])
    data = PromptDataModule(
        str(train), val=str(val), batch_size=3, prompt_key="q", answer_key="a", shuffle=False
    )
    batch = next(iter(data.train_dataloader()))
    assert [record["prompt"] for record in batch] == ["0=", "1=", "2="]
    assert data.val_records() == [{"q": "9=", "a": "0", "prompt": "9=", "answer": "0"}]


def test_file_train_without_val_has_no_held_out_records(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1=", "answer": "2"}] * 4)
    data = PromptDataModule(str(train), batch_size=2)
    assert data.val_records() == [] and list(data.val_dataloader()) == []


@pytest.mark.parametrize("batch_size", [0, -3])
def test_non_positive_batch_size_is_rejected(batch_size):
    with pytest.raises(ValueError, match=rf"batch_size={batch_size} is invalid; expected an int >= 1"):
        PromptDataModule("add_mod10", batch_size=batch_size)


def test_fewer_train_records_than_batch_size_is_rejected():
    data = PromptDataModule("add_mod10", batch_size=8, num_train_prompts=5)
    with pytest.raises(ValueError, match=r"has 5 records, fewer than batch_size=8"):
        data.setup("fit")


def test_task_kwargs_with_only_files_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"task_kwargs=\{'prefix_len': 1\} only apply to built-in tasks"):
        PromptDataModule(str(tmp_path / "train.jsonl"), task_kwargs={"prefix_len": 1})


def test_missing_train_file_error_surfaces_from_datamodule(tmp_path):
    data = PromptDataModule(str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"missing.jsonl.*digit_successor"):
        data.setup("fit")
