"""GSM8K-style rows through the data module's ``map_fn``: the prompt asks for a boxed answer, the answer
is the number after ``####``, and math-verify scores a boxed completion of it as correct."""

from __future__ import annotations

from pathlib import Path

import pytest

from unirl_lightning.data import PromptDataModule
from unirl_lightning.data.gsm8k import INSTRUCTION, gsm8k_row
from unirl_lightning.rewards import MathVerifyReward

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data" / "gsm8k_sample" / "train.jsonl"


def test_gsm8k_rows_become_prompt_records_math_verify_scores():
    data = PromptDataModule(
        train=str(SAMPLE), val=str(SAMPLE), map_fn="unirl_lightning.data.gsm8k:gsm8k_row", batch_size=1
    )
    data.setup("fit")
    records = data.train_records()
    assert [r["answer"] for r in records] == ["54", "400"]  # "1,200"-style separators never reach the answer
    assert all(r["prompt"].endswith(INSTRUCTION) for r in records)
    scores = MathVerifyReward()(["so \\boxed{54}", "\\boxed{399}"], records)
    assert scores == [1.0, 0.0]


def test_a_row_without_its_final_answer_line_names_the_question():
    with pytest.raises(ValueError, match=r"the answer of question 'How many\?' has no '#### <number>' line"):
        gsm8k_row({"question": "How many?", "answer": "about 7"})
