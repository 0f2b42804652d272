"""PromptDataModule reads datasets through the ``datasets`` library: every local form (files of
each format, save_to_disk folders, DatasetDict splits), a dataset's own column names passed through
to the reward, map/filter hooks by import path, memory-mapped rows indexed per batch, and the hub
form (``hf:<id>``) checked for its arguments without touching the hub."""

from __future__ import annotations

import json

import pytest

datasets = pytest.importorskip("datasets")

from unirl_lightning.data import PromptDataModule, load_records  # noqa: E402
from unirl_lightning.data.datamodule import PromptRecords, load_dataset_source  # noqa: E402

ROWS = [{"question": f"{i} {i}", "solution": str((i + 1) % 10), "level": i} for i in range(12)]
WANT = [{**row, "prompt": row["question"], "answer": row["solution"]} for row in ROWS]


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    """No hub, and the Arrow cache in the test's folder."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def write(path, rows=ROWS):
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        dataset = datasets.Dataset.from_list(rows)
        {".csv": dataset.to_csv, ".parquet": dataset.to_parquet}[suffix](str(path))
    return path


def keyed(**kwargs):
    return {"prompt_key": "question", "answer_key": "solution", **kwargs}


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_every_file_format_reads_with_the_datasets_own_column_names(tmp_path, suffix):
    path = write(tmp_path / f"digits{suffix}")
    records = load_records(path, **keyed())
    if suffix == ".csv":  # CSV has no types: pandas reads the digit strings as ints
        records = [{**r, "solution": str(r["solution"]), "answer": str(r["answer"])} for r in records]
    assert records == WANT


def test_an_arrow_file_reads(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    assert load_records(arrow, **keyed()) == WANT


def test_a_save_to_disk_folder_and_a_datasetdict_split(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert load_records(tmp_path / "one", **keyed()) == WANT
    split = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:8]), "test": datasets.Dataset.from_list(ROWS[8:])}
    )
    split.save_to_disk(str(tmp_path / "dict"))
    assert load_records(tmp_path / "dict", **keyed()) == WANT[:8]  # "train" by default
    assert load_records(tmp_path / "dict", **keyed(dataset_split="test")) == WANT[8:]
    with pytest.raises(ValueError, match=r"has no split 'validation'; its splits: \['test', 'train'\]"):
        load_records(tmp_path / "dict", **keyed(dataset_split="validation"))


def test_a_folder_that_is_not_a_saved_dataset_is_named(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match=r"plain' is not a folder written by Dataset.save_to_disk"):
        load_records(tmp_path / "plain")


def test_the_datamodule_trains_on_one_split_and_holds_out_another(tmp_path):
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:8]), "test": datasets.Dataset.from_list(ROWS[8:])}
    ).save_to_disk(str(tmp_path / "dict"))
    data = PromptDataModule(
        str(tmp_path / "dict"), batch_size=4, split="train", val_split="test", shuffle=False, **keyed()
    )
    batches = list(data.train_dataloader())
    assert batches == [WANT[:4], WANT[4:8]]
    assert data.val_records() == WANT[8:] and data.val_records()[:2] == WANT[8:10]


def test_rows_stay_memory_mapped_and_are_read_per_batch(tmp_path, monkeypatch):
    data = PromptDataModule(str(write(tmp_path / "d.parquet")), batch_size=4, shuffle=True, seed=3, **keyed())
    records = data.train_records()
    assert isinstance(records, PromptRecords) and isinstance(records.rows, datasets.Dataset)
    assert records.rows.cache_files  # backed by an Arrow file on disk (memory-mapped), not a Python list
    reads = []
    original = PromptRecords.__getitems__
    monkeypatch.setattr(
        PromptRecords, "__getitems__", lambda self, idx: reads.append(list(idx)) or original(self, idx)
    )
    batches = list(data.train_dataloader())
    assert [len(b) for b in batches] == [4, 4, 4] and len(reads) == 3  # one Arrow read per batch
    assert sorted(r["level"] for b in batches for r in b) == list(range(12))
    assert len(records) == 12 and records[-1] == WANT[-1] and records[1:3] == WANT[1:3]


def test_every_column_reaches_the_reward_under_its_own_name(tmp_path):
    from unirl_lightning.rewards import score_batch

    def by_level(completions, solution, level, **kwargs):
        return [float(c == s) + lvl for c, s, lvl in zip(completions, solution, level)]

    data = PromptDataModule(str(write(tmp_path / "d.jsonl")), batch_size=2, shuffle=False, **keyed())
    batch = next(iter(data.train_dataloader()))
    assert score_batch(by_level, ["1", "x"], batch) == [1.0, 1.0]


def test_map_and_filter_hooks_by_import_path(tmp_path):
    data = PromptDataModule(
        str(write(tmp_path / "d.jsonl")),
        batch_size=2,
        shuffle=False,
        map_fn="tests.unit.dataset_hooks:add_equals",
        filter_fn="tests.unit.dataset_hooks:odd_level",
        **keyed(),
    )
    records = list(data.train_records())
    assert [r["level"] for r in records] == [1, 3, 5, 7, 9, 11]
    assert records[0]["prompt"] == "1 1=" and records[0]["question"] == "1 1="


def test_chat_message_prompts_in_a_dataset(tmp_path):
    rows = [
        {"conversation": [{"role": "user", "content": f"{i}+1?"}], "solution": str(i + 1)} for i in range(3)
    ]
    records = load_records(
        write(tmp_path / "chat.jsonl", rows), prompt_key="conversation", answer_key="solution"
    )
    assert records[2]["messages"] == [{"role": "user", "content": "2+1?"}] and records[2]["prompt"] == "2+1?"


def test_a_hub_dataset_is_loaded_with_its_split_subset_and_data_files(monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, split=None, data_files=None, **kwargs):
        calls.append((path, name, split, data_files))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    data = PromptDataModule(
        "hf:openai/gsm8k", batch_size=4, split="train", val_split="test", subset="main", **keyed()
    )
    assert len(data.train_records()) == 12 and len(data.val_records()) == 12
    assert calls == [("openai/gsm8k", "main", "train", None), ("openai/gsm8k", "main", "test", None)]
    load_dataset_source("hf:me/data", data_files={"train": "a.jsonl"})
    assert calls[-1] == ("me/data", None, "train", {"train": "a.jsonl"})
