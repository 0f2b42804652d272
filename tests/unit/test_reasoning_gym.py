"""reasoning-gym as a prompt source and a reward: records from a seed with the entry its scorer needs,
held-out prompts disjoint from training ones, the dataset's own ``score_answer`` on the extracted
answer, and a wrong dataset name refused at parse time naming the closest names."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")

from reasoning_gym import get_score_answer_fn  # noqa: E402

from unirl_lightning.cli.app import run_cli  # noqa: E402
from unirl_lightning.data import PromptDataModule  # noqa: E402
from unirl_lightning.data.reasoning_gym import reasoning_gym_records  # noqa: E402
from unirl_lightning.rewards import CombinedReward, FormatReward, ReasoningGymReward, score_parts  # noqa: E402

RECIPE = str(Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny.yaml")
EASY = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def test_records_come_from_the_seed_with_the_entry_and_the_config():
    first = reasoning_gym_records("reasoning_gym:basic_arithmetic", 20, seed=3, config=EASY)
    assert first == reasoning_gym_records("reasoning_gym:basic_arithmetic", 20, seed=3, config=EASY)
    assert first != reasoning_gym_records("reasoning_gym:basic_arithmetic", 20, seed=4, config=EASY)
    for record in first:
        entry = record["reasoning_gym"]
        assert record["prompt"] == entry["question"] and record["answer"] == entry["answer"]
        assert (
            entry["metadata"]["source_dataset"] == "basic_arithmetic" and entry["metadata"]["num_terms"] == 2
        )


def test_held_out_prompts_never_meet_training_prompts():
    data = PromptDataModule(
        train="reasoning_gym:basic_arithmetic",
        task_kwargs=EASY,
        batch_size=8,
        num_train_prompts=200,
        num_val_prompts=20,
    )
    data.setup()
    train = {r["prompt"] for r in data.train_records()}
    held_out = {r["prompt"] for r in data.val_records()}
    assert len(train) == 200 and len(held_out) == 20 and not train & held_out


def test_a_million_prompts_are_generated_when_read_the_same_in_every_process_and_split():
    """Beyond LAZY_FROM prompts nothing is generated at setup: record i is a function of (seed, i), so a
    second data module (another process, a resume) reads the same record; held-out stays disjoint."""
    from unirl_lightning.data.reasoning_gym import LAZY_FROM, LazyRecords

    def module() -> PromptDataModule:
        data = PromptDataModule(
            train="reasoning_gym:chain_sum",
            batch_size=4,
            num_train_prompts=1_000_000,
            num_val_prompts=LAZY_FROM + 1,
        )
        data.setup()
        return data

    first, second = module(), module()
    train, held_out = first.train_records(), first.val_records()
    assert isinstance(train, LazyRecords) and isinstance(held_out, LazyRecords)
    assert len(train) == 1_000_000 and len(held_out) == LAZY_FROM + 1
    picks = [0, 1, 123_456, 999_999]
    assert [train[i] for i in picks] == [second.train_records()[i] for i in picks]
    assert train[-1] == train[999_999] and train[0] != train[1]
    assert not {train[i]["prompt"] for i in range(500)} & {held_out[i]["prompt"] for i in range(500)}
    with pytest.raises(IndexError, match="record 1000000 of 1000000"):
        train[1_000_000]
    loader = first.train_dataloader()
    loader.sampler.set_epoch(0)
    batch = next(iter(loader))
    assert len(batch) == 4 and all(
        r["reasoning_gym"]["metadata"]["source_dataset"] == "chain_sum" for r in batch
    )


def test_lazy_records_name_the_config_when_it_yields_too_few_questions(monkeypatch):
    from unirl_lightning.data import reasoning_gym

    records = reasoning_gym_records("reasoning_gym:chain_sum", 20_000, seed=0, partition="held_out")
    assert records[5]["prompt"]
    monkeypatch.setattr(
        reasoning_gym, "_partition", lambda question: "train"
    )  # a config with no held-out question
    with pytest.raises(
        ValueError, match=r"gave no held_out prompt in entries 1280-1535: .* too few distinct questions"
    ):
        records[5]


def test_a_composite_mixes_datasets_and_each_record_is_scored_by_its_own_dataset():
    config = {
        "datasets": [
            {"name": "basic_arithmetic", "weight": 1, "config": EASY},
            {"name": "chain_sum", "weight": 1},
        ]
    }
    records = reasoning_gym_records("reasoning_gym:composite", 30, seed=0, config=config)
    sources = {r["reasoning_gym"]["metadata"]["source_dataset"] for r in records}
    assert sources == {"basic_arithmetic", "chain_sum"}
    reward = ReasoningGymReward(answer_format="full")
    assert reward([str(r["answer"]) for r in records], records) == [1.0] * 30
    assert reward(["not a number"] * 30, records) == [0.0] * 30


@pytest.mark.parametrize(
    ("answer_format", "template"),
    [
        ("answer_tag", "think... <answer>{}</answer>"),
        ("boxed", "so \\boxed{{{}}}"),
        ("last_line", "steps\n{}\n"),
        ("full", " {} "),
    ],
)
def test_the_answer_is_read_in_each_format_and_scored_by_reasoning_gym(answer_format, template):
    records = reasoning_gym_records("reasoning_gym:basic_arithmetic", 4, seed=1, config=EASY)
    reward = pickle.loads(pickle.dumps(ReasoningGymReward(answer_format=answer_format)))  # shipped to workers
    right = [template.format(r["answer"]) for r in records]
    wrong = [template.format("12345") for _ in records]
    assert reward(right, records) == [1.0] * 4
    scorer = get_score_answer_fn("basic_arithmetic")  # partial credit is reasoning-gym's to give
    assert reward(wrong, records) == [scorer("12345", r["reasoning_gym"]) for r in records]
    assert max(reward(wrong, records)) < 1.0
    if answer_format in ("answer_tag", "boxed"):  # no answer in that format: 0
        assert reward([str(r["answer"]) for r in records], records) == [0.0] * 4


def test_the_format_is_logged_apart_when_combined_with_a_format_reward():
    records = reasoning_gym_records("reasoning_gym:basic_arithmetic", 2, seed=1, config=EASY)
    reward = CombinedReward([ReasoningGymReward(), FormatReward(r"<answer>.*</answer>")], weights=[1.0, 0.1])
    completions = [f"<answer>{records[0]['answer']}</answer>", "<answer>x</answer>"]
    total, parts = score_parts(reward, completions, records)
    assert total == [1.1, 0.1] and parts == {"reasoning_gym": [1.0, 0.0], "format": [1.0, 1.0]}


def test_a_record_without_an_entry_is_refused_naming_the_source_to_use():
    with pytest.raises(ValueError, match="reasoning_gym:<name>"):
        ReasoningGymReward()(["1"], [{"prompt": "1+0=", "answer": "1"}])


def test_a_wrong_dataset_name_or_config_is_refused_at_parse_time_naming_the_closest(
    capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["fit", "--config", RECIPE, "--data.train=reasoning_gym:basic_arithmetc"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no dataset 'basic_arithmetc'; closest: basic_arithmetic" in last, last
    with pytest.raises(
        ValueError, match="data.init_args.task_kwargs: reasoning-gym's 'basic_arithmetic' refused"
    ):
        reasoning_gym_records("reasoning_gym:basic_arithmetic", 2, seed=0, config={"bogus": 1})
