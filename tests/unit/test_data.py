"""Pins unirl_lightning.data: built-in task answers, word problems checked by math-verify, the
train / held-out split, file loading, PromptDataModule batching and errors."""

from __future__ import annotations

import ast
import json
import operator
import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unirl_lightning.data import BUILTIN_TASKS, PromptDataModule, is_held_out, load_records, make_task
from unirl_lightning.data.datamodule import VAL_SEED_OFFSET
from unirl_lightning.data.tasks import HELD_OUT_PERCENT, WORD_PROBLEM_INSTRUCTION, WORD_PROBLEM_TEMPLATES
from unirl_lightning.rewards import MathVerifyReward

TASK_VOCABULARY = set("0123456789+= ")
DIGIT_TASKS = ["add_mod10", "copy_first", "digit_successor"]


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
def test_tasks_are_deterministic_per_seed(name):
    first = make_task(name, num_prompts=30, seed=7)
    assert first == make_task(name, num_prompts=30, seed=7)
    assert first != make_task(name, num_prompts=30, seed=8)
    assert len(first) == 30


@pytest.mark.parametrize("name", DIGIT_TASKS)
def test_digit_tasks_use_the_small_vocabulary_and_one_digit_answers(name):
    records = make_task(name, num_prompts=30, seed=7)
    assert all(set(record["prompt"]) <= TASK_VOCABULARY for record in records)
    assert all(len(record["answer"]) == 1 and record["answer"].isdigit() for record in records)


def test_unknown_task_lists_builtin_names():
    with pytest.raises(
        ValueError,
        match=r"'mult'.*\['add_mod10', 'copy_first', 'digit_successor', 'python_functions', 'word_problems'\]",
    ):
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
    with pytest.raises(
        ValueError, match=r"partition='test' is invalid for task 'add_mod10'; expected None, 'train'"
    ):
        make_task("add_mod10", num_prompts=1, seed=0, partition="test")


# ---------------------------------------------------------------- word problems

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate_exactly(expression: str) -> Fraction:
    """The value of ``+ - * /`` over integer literals, in exact fractions (independent of the task code)."""

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        raise AssertionError(f"unexpected node {ast.dump(node)} in {expression!r}")

    return walk(ast.parse(expression, mode="eval").body)


@pytest.fixture(scope="module", params=["multi_step", "easy"])
def word_problem_records(request):
    return make_task("word_problems", num_prompts=400, seed=0, difficulty=request.param)


def test_every_word_problem_answer_is_verified_by_math_verify_when_boxed(word_problem_records):
    reward = MathVerifyReward()
    boxed = [f"The answer is \\boxed{{{record['answer']}}}." for record in word_problem_records]
    assert reward(boxed, word_problem_records) == [1.0] * len(word_problem_records)
    off_by_one = [f"\\boxed{{{int(record['answer']) + 1}}}" for record in word_problem_records[:50]]
    assert reward(off_by_one, word_problem_records[:50]) == [0.0] * 50


def test_word_problem_answer_is_its_expression_a_whole_number_over_numbers_from_the_problem(
    word_problem_records,
):
    for record in word_problem_records:
        value = evaluate_exactly(record["expression"])
        assert value.denominator == 1 and value >= 0, record
        assert record["answer"] == str(value.numerator), record
        problem_numbers = set(re.findall(r"\d+", record["prompt"]))
        assert set(re.findall(r"\d+", record["expression"])) - {"2"} <= problem_numbers, record


def test_multi_step_word_problems_mix_templates_operations_and_multi_digit_answers():
    word_problem_records = make_task("word_problems", num_prompts=400, seed=0)
    openings = {record["prompt"].split(" ")[1] for record in word_problem_records}
    assert len(openings) >= 6  # several templates appear
    operations = {op for record in word_problem_records for op in "+-*/" if f" {op} " in record["expression"]}
    assert operations == set("+-*/")
    assert all(record["expression"].count(" ") >= 4 for record in word_problem_records)  # >= two operations
    assert sum(int(record["answer"]) >= 100 for record in word_problem_records) > 200
    assert len({record["prompt"] for record in word_problem_records}) == len(word_problem_records)
    assert len(WORD_PROBLEM_TEMPLATES) == 10


def test_easy_word_problems_are_one_operation_on_numbers_up_to_20():
    records = make_task("word_problems", num_prompts=300, seed=4, difficulty="easy")
    operations = set()
    for record in records:
        left, operation, right = record["expression"].split(" ")
        operations.add(operation)
        assert 1 <= int(left) <= 20 and 1 <= int(right) <= 20, record
    assert operations == {"+", "-", "*"}
    with pytest.raises(
        ValueError, match=r"difficulty='hard' is invalid; expected one of \['easy', 'multi_step'\]"
    ):
        make_task("word_problems", num_prompts=1, seed=0, difficulty="hard")


def test_word_problems_end_with_the_boxed_instruction_which_task_kwargs_replace():
    default = make_task("word_problems", num_prompts=3, seed=1)
    assert all(record["prompt"].endswith("\n" + WORD_PROBLEM_INSTRUCTION) for record in default)
    assert "\\boxed{" in WORD_PROBLEM_INSTRUCTION
    custom = make_task("word_problems", num_prompts=3, seed=1, instruction="Answer in one number.")
    assert [record["prompt"].split("\n")[0] for record in custom] == [
        record["prompt"].split("\n")[0] for record in default
    ]
    assert all(record["prompt"].endswith("\nAnswer in one number.") for record in custom)


# ---------------------------------------------------------------- train / held-out split


def test_is_held_out_is_a_stable_hash_of_the_prompt_holding_out_about_ten_percent():
    assert [prompt for prompt in (f"{d}=" for d in range(10)) if is_held_out(prompt)] == ["5="]
    prompts = {record["prompt"] for record in make_task("word_problems", num_prompts=3000, seed=5)}
    share = sum(map(is_held_out, prompts)) / len(prompts)
    assert HELD_OUT_PERCENT == 10 and 0.08 < share < 0.12


@settings(max_examples=30, deadline=None)
@given(
    task=st.sampled_from(
        [
            ("word_problems", {}),
            ("word_problems", {"difficulty": "easy"}),
            ("digit_successor", {"prefix_len": 2}),
            ("copy_first", {}),
            ("add_mod10", {}),
        ]
    ),
    train_seed=st.integers(0, 10**9),
    held_out_seed=st.integers(0, 10**9),
    num_train=st.integers(0, 300),
    num_held_out=st.integers(0, 60),
)
def test_train_and_held_out_splits_never_share_a_prompt_for_any_seeds_and_sizes(
    task, train_seed, held_out_seed, num_train, num_held_out
):
    name, kwargs = task
    train = make_task(name, num_train, train_seed, partition="train", **kwargs)
    held_out = make_task(name, num_held_out, held_out_seed, partition="held_out", **kwargs)
    assert len(train) == num_train and len(held_out) == num_held_out
    assert not {record["prompt"] for record in train} & {record["prompt"] for record in held_out}
    assert not any(is_held_out(record["prompt"]) for record in train)
    assert all(is_held_out(record["prompt"]) for record in held_out)
    assert held_out == make_task(name, num_held_out, held_out_seed, partition="held_out", **kwargs)


def test_a_split_keeps_the_task_draws_in_order_minus_the_other_side():
    draws = make_task("word_problems", num_prompts=500, seed=3)
    assert (
        make_task("word_problems", 40, seed=3, partition="train")
        == [record for record in draws if not is_held_out(record["prompt"])][:40]
    )
    assert (
        make_task("word_problems", 20, seed=3, partition="held_out")
        == [record for record in draws if is_held_out(record["prompt"])][:20]
    )


def test_a_split_side_with_no_prompt_names_the_task_and_the_ways_out(monkeypatch):
    def only_seven(num_prompts, seed):
        return [{"prompt": "7=", "answer": "8", "task": "only_seven"}] * num_prompts

    monkeypatch.setitem(BUILTIN_TASKS, "only_seven", only_seven)
    assert make_task("only_seven", 2, seed=0, partition="train") == only_seven(2, 0)
    with pytest.raises(
        ValueError,
        match=r"Task 'only_seven' \(kwargs \{\}\) gave 0 of the 3 'held_out' prompts.*"
        r"too small to split.*held_out='resample'",
    ):
        make_task("only_seven", 3, seed=0, partition="held_out")


# ---------------------------------------------------------------- files


@pytest.fixture(autouse=True)
def _datasets_cache_in_tmp(tmp_path, monkeypatch):
    """Keep the ``datasets`` Arrow cache of these tests out of the user's cache folder."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def test_jsonl_records_are_normalised_to_prompt_answer_and_keep_other_keys(tmp_path):
    path = write_jsonl(
        tmp_path / "qa.jsonl",
        [{"question": "1+1=", "solution": "2", "level": 1}, {"question": "2+2=", "solution": "4"}],
        raw_lines=[""],
    )
    records = load_records(path, prompt_key="question", answer_key="solution")
    assert records == [
        {"question": "1+1=", "solution": "2", "level": 1, "prompt": "1+1=", "answer": "2"},
        {"question": "2+2=", "solution": "4", "level": None, "prompt": "2+2=", "answer": "4"},
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


def test_dataset_missing_prompt_column_names_key_columns_and_file(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "b", "answer": "2"}] * 2)
    with pytest.raises(
        ValueError,
        match=rf"{re.escape(str(path))}: the dataset has no prompt column 'prompt' \(columns: \['answer', 'text'\]\)",
    ):
        load_records(path)


def test_record_missing_prompt_in_one_row_names_the_row_and_file(tmp_path):
    path = write_jsonl(
        tmp_path / "bad.jsonl", [{"prompt": "a", "answer": "1"}] * 2 + [{"text": "b", "answer": "2"}]
    )
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(path))}, row 3: prompt key 'prompt' holds NoneType None"
    ):
        load_records(path)


def test_dataset_missing_answer_column_is_an_error_unless_answer_key_is_none(tmp_path):
    path = write_jsonl(tmp_path / "open.jsonl", [{"prompt": "write a poem"}])
    with pytest.raises(ValueError, match=r"no answer column 'answer'.*answer_key=None"):
        load_records(path)
    assert load_records(path, answer_key=None) == [{"prompt": "write a poem"}]


def test_chat_message_records_keep_messages_and_prompt_is_the_last_user_turn(tmp_path):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages, "answer": "6"}])
    assert load_records(path, prompt_key="messages") == [
        {"messages": messages, "answer": "6", "prompt": "and 3+3?"}
    ]


def test_malformed_chat_messages_name_the_message_and_row(tmp_path):
    no_user = write_jsonl(
        tmp_path / "no_user.jsonl", [{"messages": [{"role": "system", "content": "x"}], "answer": "1"}]
    )
    with pytest.raises(ValueError, match=r"row 1: chat messages under 'messages' have no 'user' turn"):
        load_records(no_user, prompt_key="messages")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user"}], "answer": "1"}])
    with pytest.raises(
        ValueError, match=r"row 1: message 0 under 'messages' is \{'role': 'user'\}; expected"
    ):
        load_records(bad, prompt_key="messages")


def test_invalid_json_names_the_file_and_non_string_prompt_names_the_row(tmp_path):
    broken = write_jsonl(tmp_path / "broken.jsonl", [{"prompt": "a", "answer": "1"}], raw_lines=["{not json"])
    with pytest.raises(ValueError, match=r"broken.jsonl' could not be read as json"):
        load_records(broken)
    numeric = write_jsonl(tmp_path / "numeric.jsonl", [{"prompt": 5, "answer": "1"}])
    with pytest.raises(ValueError, match=r"row 1: prompt key 'prompt' holds int 5; expected a str or a list"):
        load_records(numeric)


def test_missing_file_names_path_and_builtin_tasks(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match=r"nope.jsonl.*built-in tasks: \['add_mod10', 'copy_first'"):
        load_records(str(missing))


def test_unsupported_suffix_and_empty_file_are_rejected(tmp_path):
    odd = tmp_path / "data.xlsx"
    odd.write_text("prompt,answer\n")
    with pytest.raises(ValueError, match=r"suffix '.xlsx'; supported: \['.jsonl', '.json', '.csv'"):
        load_records(odd)
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


def test_builtin_val_defaults_to_same_task_with_another_seed_resampled():
    data = PromptDataModule("copy_first", batch_size=4, num_train_prompts=8, num_val_prompts=6, seed=3)
    held_out = data.val_records()
    assert held_out == make_task("copy_first", num_prompts=6, seed=3 + VAL_SEED_OFFSET)
    assert held_out != make_task("copy_first", num_prompts=6, seed=3)


@pytest.mark.parametrize(
    ("train", "task_kwargs"), [("word_problems", None), ("digit_successor", {"prefix_len": 2})]
)
def test_disjoint_held_out_records_are_never_training_records(train, task_kwargs):
    data = PromptDataModule(
        train,
        batch_size=8,
        num_train_prompts=400,
        num_val_prompts=40,
        held_out="disjoint",
        task_kwargs=task_kwargs,
    )
    train_prompts = {record["prompt"] for record in data.train_records()}
    val_prompts = {record["prompt"] for record in data.val_records()}
    assert len(data.train_records()) == 400 and len(data.val_records()) == 40
    assert not train_prompts & val_prompts
    assert all(map(is_held_out, val_prompts)) and not any(map(is_held_out, train_prompts))
    kwargs = task_kwargs or {}
    assert data.val_records() == make_task(train, 40, VAL_SEED_OFFSET, partition="held_out", **kwargs)


def test_disjoint_digit_successor_without_prefix_holds_out_one_of_its_ten_prompts():
    data = PromptDataModule("digit_successor", batch_size=4, num_train_prompts=64, held_out="disjoint")
    assert {record["prompt"] for record in data.val_records()} == {"5="}
    assert {record["prompt"] for record in data.train_records()} == {f"{d}=" for d in range(10) if d != 5}


def test_resample_keeps_all_ten_digit_successor_prompts_in_training_for_the_demo():
    data = PromptDataModule("digit_successor", batch_size=16, num_train_prompts=1024)
    assert data.held_out == "resample"
    assert {record["prompt"] for record in data.train_records()} == {f"{d}=" for d in range(10)}
    assert len(data.val_records()) == 64


def test_invalid_held_out_is_rejected_naming_the_allowed_values():
    with pytest.raises(
        ValueError, match=r"held_out='never' is invalid; expected one of \['disjoint', 'resample'\]"
    ):
        PromptDataModule("word_problems", held_out="never")


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
    assert data.val_records() == []


@pytest.mark.parametrize("batch_size", [0, -3])
def test_non_positive_batch_size_is_rejected(batch_size):
    with pytest.raises(ValueError, match=rf"batch_size={batch_size} is invalid; expected an int >= 1"):
        PromptDataModule("add_mod10", batch_size=batch_size)


def test_fewer_train_records_than_batch_size_is_rejected():
    data = PromptDataModule("add_mod10", batch_size=8, num_train_prompts=5)
    with pytest.raises(ValueError, match=r"has 5 records, fewer than batch_size=8"):
        data.setup("fit")


def test_task_kwargs_with_only_files_are_ignored_with_one_warning_naming_them(tmp_path, caplog):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1=", "answer": "2"}] * 4)
    with caplog.at_level("WARNING", logger="unirl_lightning.data.datamodule"):
        data = PromptDataModule(str(train), batch_size=2, task_kwargs={"prefix_len": 1})
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "['prefix_len'] are ignored" in warnings[0]
    assert data.task_kwargs == {} and len(data.train_records()) == 4


def test_missing_train_file_error_surfaces_from_datamodule(tmp_path):
    data = PromptDataModule(str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"missing.jsonl.*digit_successor"):
        data.setup("fit")


# -- the order of each pass, and an exact resume in any pass -------------------------------------------
def numbered(count):
    return [{"prompt": f"p{i}", "answer": str(i)} for i in range(count)]


def test_a_pass_on_one_rank_is_ordered_as_a_one_replica_distributed_sampler():
    from torch.utils.data import DistributedSampler

    from unirl_lightning.data.datamodule import PassSampler

    sampler, reference = (
        PassSampler(10, shuffle=True, seed=3),
        DistributedSampler(range(10), num_replicas=1, rank=0, shuffle=True, seed=3, drop_last=True),
    )
    orders = []
    for epoch in range(3):
        reference.set_epoch(epoch)
        orders.append(list(sampler))  # a full pass moves on to the next one by itself
        assert orders[-1] == list(reference) == sampler.order(epoch)
    assert len({tuple(order) for order in orders}) == 3 and all(sorted(o) == list(range(10)) for o in orders)
    sampler.set_epoch(1)  # re-positioned: pass 1 again, whatever came before
    assert list(sampler) == orders[1]
    assert list(PassSampler(4, shuffle=False, seed=3)) == [0, 1, 2, 3]


@pytest.mark.parametrize(("num_records", "batch_size"), [(12, 3), (10, 3)])
def test_a_stream_resumed_in_its_third_pass_yields_exactly_the_records_not_yet_yielded(
    num_records, batch_size
):
    from unirl_lightning.data.datamodule import train_loader
    from unirl_lightning.rollout.loop import PromptStream

    def loader():
        return train_loader(numbered(num_records), batch_size, shuffle=True, seed=7)

    def prompts(batch):
        return [record["prompt"] for record in batch]

    per_pass = num_records // batch_size
    stream = PromptStream(loader())
    passes = [[prompts(stream.next_records()) for _ in range(per_pass)] for _ in range(2)]
    done = [prompts(stream.next_records()) for _ in range(2)]  # two batches into the third pass
    position = stream.position()
    assert position == {
        "prompt_batches_used": 2 * per_pass + 2,
        "prompt_epoch": 2,
        "epoch_start": 2 * per_pass,
    }
    rest = [prompts(stream.next_records()) for _ in range(per_pass - 2)]
    fourth = [prompts(stream.next_records()) for _ in range(per_pass)]

    resumed = PromptStream(loader())  # a fresh process: a new dataloader, its sampler at pass 0
    resumed.restore(position, replay=[])
    assert [prompts(resumed.next_records()) for _ in range(per_pass - 2)] == rest
    assert [prompts(resumed.next_records()) for _ in range(per_pass)] == fourth
    assert resumed.position() == stream.position()

    third = done + rest
    for batches in [*passes, third, fourth]:
        flat = [p for batch in batches for p in batch]
        assert len(flat) == len(set(flat)) == per_pass * batch_size  # each prompt of a pass at most once
        if num_records % batch_size == 0:
            assert sorted(flat) == sorted(prompts(numbered(num_records)))  # ... and exactly once
    assert len({tuple(map(tuple, batches)) for batches in [*passes, third, fourth]}) == 4  # reshuffled
