"""GSM8K-style rows as prompt records: ``map_fn: unirl_lightning.data.gsm8k:gsm8k_row`` on a dataset with
``question`` and ``answer`` columns, where the answer is the worked solution ending in ``#### <number>``
(GSM8K's own format). The row gets a ``prompt`` (the question and an instruction to box the final
answer, which :class:`~unirl_lightning.rewards.MathVerifyReward` reads) and an ``answer`` (the number
after ``####``, thousands separators removed); the worked solution stays as ``solution``. With
``chat: true`` on the policy the prompt is rendered in the model's chat template, so no template goes
into the data.

>>> gsm8k_row({"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\\n#### 7"})["answer"]
'7'
>>> gsm8k_row({"question": "q", "answer": "... #### 1,250"})["answer"]
'1250'
"""

from __future__ import annotations

from typing import Any

__all__ = ["INSTRUCTION", "gsm8k_row"]

INSTRUCTION = "Let's think step by step and put the final answer in \\boxed{}."


def gsm8k_row(row: dict[str, Any]) -> dict[str, Any]:
    """``{"question", "answer": "... #### N"}`` -> ``{"prompt", "answer": "N", "solution"}``; a row whose
    answer has no ``####`` raises ``ValueError`` naming the row's question."""
    solution = str(row["answer"])
    if "####" not in solution:
        raise ValueError(
            f"gsm8k_row: the answer of question {str(row.get('question'))[:60]!r} has no '#### <number>' line"
        )
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return {**row, "prompt": f"{row['question']}\n{INSTRUCTION}", "answer": final, "solution": solution}
