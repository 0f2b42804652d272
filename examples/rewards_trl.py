"""Reward functions written the way TRL's ``GRPOTrainer`` takes them (``reward_funcs``).

A function whose first parameter is ``completions`` is called once per batch with the prompts and
every dataset column as keyword arguments (here ``solution``, the column of
``examples/data/digit_successor``), and returns one score per completion (``None``: no opinion).
``examples/grpo_tiny_dataset.yaml`` combines :func:`digit_reward` and :func:`answers_a_digit`.
"""

from __future__ import annotations


def digit_reward(completions: list[str], solution: list[str], **kwargs) -> list[float]:
    """1.0 when the completion starts with the solution digit, else 0.0."""
    return [1.0 if c.strip().startswith(str(s)) else 0.0 for c, s in zip(completions, solution)]


def answers_a_digit(completions: list[str], **kwargs) -> list[float | None]:
    """1.0 when the completion starts with a digit, 0.0 when it starts with anything else, and no
    opinion (``None``) on an empty completion."""
    return [None if not c.strip() else float(c.strip()[0].isdigit()) for c in completions]
