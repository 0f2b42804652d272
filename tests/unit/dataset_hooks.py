"""``map_fn`` / ``filter_fn`` hooks given by import path, for tests/unit/test_datasets.py."""

from __future__ import annotations


def add_equals(row):
    return {**row, "question": row["question"] + "="}


def odd_level(row):
    return row["level"] % 2 == 1
