"""``PromptDataModule(max_prompt_length)``: the records whose rendered prompt is longer are dropped
from training and held-out data, counted and logged; the length is the module's own rendering (chat
template included); built-in tasks and memory-mapped datasets alike."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.builders import tiny_module
from unirl_lightning.data import PromptDataModule


class Recorder:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.logged.append((metrics, step))


def attach(data: PromptDataModule, module) -> Recorder:
    logger = Recorder()
    data.trainer = SimpleNamespace(lightning_module=module, loggers=[logger])
    return logger


def test_overlong_prompts_are_dropped_counted_and_logged_on_both_sides():
    module = tiny_module()
    lengths = [
        len(r["prompt"]) for r in PromptDataModule("word_problems", num_train_prompts=64).train_records()
    ]
    cap = sorted(lengths)[len(lengths) // 2]
    data = PromptDataModule("word_problems", num_train_prompts=64, num_val_prompts=32, max_prompt_length=cap)
    logger = attach(data, module)
    data.setup("fit")
    train, val = data.train_records(), data.val_records()
    assert all(module.prompt_length(r) <= cap for r in [*train, *val])
    assert data.dropped_prompts["train"] == sum(n > cap for n in lengths) == 64 - len(train) > 0
    assert data.dropped_prompts["val"] == 32 - len(val)
    assert logger.logged == [
        ({"data/dropped_prompts/train": float(64 - len(train))}, 0),
        ({"data/dropped_prompts/val": float(32 - len(val))}, 0),
    ]


def test_a_dataset_file_keeps_its_rows_under_the_cap(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": "12+13+14+15=", "answer": "54"},
        {"prompt": "3=", "answer": "3"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    data = PromptDataModule(str(path), batch_size=1, max_prompt_length=4)
    attach(data, tiny_module())
    data.setup("fit")
    assert [r["prompt"] for r in data.train_records()] == ["1+1=", "3="]
    assert data.dropped_prompts == {
        "empty/train": 0,
        "no_answer/train": 0,
        "train": 1,
    }  # by reason; the cap under "train"


def test_the_length_is_the_modules_rendering_with_its_chat_template():
    module = tiny_module()
    record = {"prompt": "2+2="}
    assert module.prompt_length(record) == len(module.policy_spec.prompt_ids(module.tokenizer, record)) == 4


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match=r"max_prompt_length=0 is invalid; expected an int >= 1"):
        PromptDataModule("word_problems", max_prompt_length=0)
    data = PromptDataModule("word_problems", max_prompt_length=8)
    with pytest.raises(ValueError, match=r"max_prompt_length=8 needs the module's tokenizer"):
        data.setup("fit")
