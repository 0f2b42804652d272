"""reasoning-gym's procedural datasets as a prompt source: ``data.train: "reasoning_gym:<name>"``.

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ generates about a hundred reasoning
datasets (arithmetic, chain sums, countdown, logic, graphs, games, ...) from a seed, each with its own
scorer. A record keeps the entry reasoning-gym scores against (``record["reasoning_gym"]``: its
question, answer and metadata), so :class:`~unirl_lightning.rewards.ReasoningGymReward` calls that
dataset's own ``score_answer``. The data module's ``task_kwargs`` is the dataset's config (e.g.
``{"min_terms": 2, "max_terms": 3}``); ``reasoning_gym:composite`` mixes several with weights:
``task_kwargs: {datasets: [{name: basic_arithmetic, weight: 2, config: {...}}, {name: chain_sum, weight: 1}]}``.

Held-out prompts never meet training ones: an entry belongs to the held-out partition when a hash of
its question falls in one bucket of ten, to training otherwise, and each split reads entries of its
own partition (training from the data seed, held-out from the held-out seed). An optional extra:
``pip install "unirl-lightning[reasoning-gym]"``.

Up to :data:`LAZY_FROM` prompts are generated when the data module is set up, without duplicate
questions. Beyond that, the records are a :class:`LazyRecords`: record ``i`` is generated when it is
read, from entries ``i * SPAN ...`` of the dataset (reasoning-gym generates entry ``k`` from ``seed +
k`` alone), so a million prompts cost nothing at setup and record ``i`` is the same in every process
and after a resume (the pass order is the sampler's, a function of the data seed and the pass).
Duplicate questions are not removed there.
"""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Sequence
from typing import Any

__all__ = [
    "LAZY_FROM",
    "PREFIX",
    "LazyRecords",
    "dataset_names",
    "is_reasoning_gym",
    "reasoning_gym_records",
    "task_error",
]

PREFIX = "reasoning_gym:"
HELD_OUT_BUCKETS = 10  # one bucket of ten is held out
MAX_DRAWS_PER_RECORD = 50  # a dataset whose partition is this sparse is too small for the request
LAZY_FROM = 10_000  # more prompts than this: generated when read (LazyRecords)
SPAN = 256  # LazyRecords: the entries record i may come from (no held-out one among them: 0.9**256 ~ 2e-12)


def is_reasoning_gym(source: Any) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def _library() -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ImportError(
            'data.init_args.train="reasoning_gym:..." needs reasoning-gym: pip install "unirl-lightning[reasoning-gym]" '
            "(make test installs it)"
        ) from exc
    return reasoning_gym


def dataset_names() -> list[str]:
    """Every dataset reasoning-gym registers, sorted."""
    return sorted(_library().factory.DATASETS)


def task_error(source: str, key: str = "data.init_args.train") -> str | None:
    """Why ``source`` names no reasoning-gym dataset (naming the closest names), or None."""
    name = source[len(PREFIX) :]
    names = dataset_names()
    if name in names:
        return None
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    hint = f"; closest: {', '.join(close)}" if close else f"; {len(names)} names, e.g. {', '.join(names[:5])}"
    return f"{key}={source!r}: reasoning-gym has no dataset {name!r}{hint}"


def _partition(question: str) -> str:
    digest = hashlib.blake2b(question.encode(), digest_size=8).digest()
    return "held_out" if int.from_bytes(digest, "little") % HELD_OUT_BUCKETS == 0 else "train"


def _dataset(name: str, size: int, seed: int, config: dict[str, Any]) -> Any:
    library = _library()
    config = dict(config)
    if name == "composite":
        specs = config.pop("datasets", None)
        if not specs:
            raise ValueError(
                "data.init_args.task_kwargs.datasets: reasoning_gym:composite needs a list of "
                "{name, weight, config} entries"
            )
        config["datasets"] = [
            library.composite.DatasetSpec(s["name"], float(s.get("weight", 1.0)), dict(s.get("config") or {}))
            for s in specs
        ]
    try:
        return library.create_dataset(name, size=size, seed=seed, **config)
    except (TypeError, ValueError, AssertionError, KeyError) as exc:
        raise ValueError(
            f"data.init_args.task_kwargs: reasoning-gym's {name!r} refused its config {config}: {exc}"
        ) from exc


def _record(entry: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": entry["question"], "answer": entry["answer"], "reasoning_gym": entry}


class LazyRecords(Sequence):
    """``num_prompts`` records of a reasoning-gym dataset, each generated when read: record ``i`` is the
    first entry of ``partition`` among the dataset's entries ``i * SPAN`` to ``(i + 1) * SPAN - 1``.

    >>> records = reasoning_gym_records("reasoning_gym:chain_sum", 1_000_000, seed=3)
    >>> len(records), records[999_999] == records[-1], records[7]["prompt"] == records[7]["reasoning_gym"]["question"]
    (1000000, True, True)
    """

    def __init__(self, name: str, dataset: Any, num_prompts: int, partition: str | None) -> None:
        self.name, self.dataset, self.num_prompts, self.partition = name, dataset, num_prompts, partition

    def __len__(self) -> int:
        return self.num_prompts

    def __getitem__(self, index: int) -> dict[str, Any]:  # type: ignore[override]
        if not isinstance(index, int):
            raise TypeError(f"LazyRecords indices are integers, not {type(index).__name__}")
        if index < 0:
            index += self.num_prompts
        if not 0 <= index < self.num_prompts:
            raise IndexError(f"record {index} of {self.num_prompts}")
        for k in range(index * SPAN, (index + 1) * SPAN):
            entry = self.dataset[k]
            if self.partition is None or _partition(entry["question"]) == self.partition:
                return _record(entry)
        raise ValueError(
            f"data.init_args: reasoning-gym's {self.name!r} gave no {self.partition} prompt in entries "
            f"{index * SPAN}-{(index + 1) * SPAN - 1}: its config yields too few distinct questions for "
            f"{self.num_prompts} prompts; ask for fewer (at most {LAZY_FROM} are drawn without duplicates)"
        )


def reasoning_gym_records(
    source: str,
    num_prompts: int,
    seed: int,
    config: dict[str, Any] | None = None,
    partition: str | None = "train",
) -> list[dict] | LazyRecords:
    """``num_prompts`` records of reasoning-gym's dataset ``source`` (``"reasoning_gym:<name>"``) drawn
    from ``seed``, all of ``partition`` (``"train"`` or ``"held_out"``; None: every entry): a list of
    distinct questions, or beyond :data:`LAZY_FROM` prompts a :class:`LazyRecords`.

    >>> records = reasoning_gym_records("reasoning_gym:basic_arithmetic", 2, seed=1)
    >>> sorted(records[0]), records[0]["prompt"] == records[0]["reasoning_gym"]["question"]
    (['answer', 'prompt', 'reasoning_gym'], True)
    """
    error = task_error(source)
    if error is not None:
        raise ValueError(error)
    name = source[len(PREFIX) :]
    if num_prompts > LAZY_FROM:
        return LazyRecords(
            name, _dataset(name, num_prompts * SPAN, seed, config or {}), num_prompts, partition
        )
    draws = num_prompts * MAX_DRAWS_PER_RECORD  # duplicates and the other partition are skipped
    dataset = _dataset(name, draws, seed, config or {})
    records: list[dict] = []
    seen: set[str] = set()
    for index in range(draws):
        entry = dataset[index]
        question = entry["question"]
        if question in seen or (partition is not None and _partition(question) != partition):
            continue
        seen.add(question)
        records.append(_record(entry))
        if len(records) == num_prompts:
            return records
    raise ValueError(
        f"data.init_args: reasoning-gym's {name!r} gave {len(records)} distinct {partition or ''} prompts in "
        f"{draws} draws, fewer than the {num_prompts} asked for: ask for fewer prompts or widen its config "
        "(data.init_args.task_kwargs)"
    )
