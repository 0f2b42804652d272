"""CompletionLogger: prompts, completions and rewards as a TensorBoard text table, read back from
the event file (training batches and an evaluation's rollouts)."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch import Callback

from tests.builders import fit_tiny
from unirl_lightning.callbacks import CompletionLogger
from unirl_lightning.strategy import AsyncRolloutStrategy

pytestmark = pytest.mark.usefixtures("ray_local")


def read_texts(log_dir: str) -> dict[str, list[tuple[int, str]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    texts: dict[str, list[tuple[int, str]]] = {}
    for path in Path(log_dir).rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(path), size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            for event in acc.Tensors(tag):
                texts.setdefault(tag, []).append((event.step, event.tensor_proto.string_val[0].decode()))
    return texts


class FirstRows(Callback):
    """The decoded first row of every batch, and one evaluation logged through the logger at the end."""

    def __init__(self, logger: CompletionLogger) -> None:
        self.logger = logger
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        start = int(batch.response_mask[0].nonzero()[0])
        end = int(batch.attention_mask[0].sum())
        decode = pl_module.tokenizer.decode
        self.rows.append(
            {
                "prompt": decode(batch.input_ids[0, :start].tolist(), skip_special_tokens=True),
                "completion": decode(batch.input_ids[0, start:end].tolist(), skip_special_tokens=True),
                "reward": float(batch.rewards[0]),
            }
        )

    def on_train_end(self, trainer, pl_module):
        records = trainer.datamodule.val_records()[:2]
        sampling = pl_module.eval_sampling(0.0)
        self.eval_groups = trainer.strategy.evaluate(records, sampling, n=2, seed=0)
        self.logger.log_eval(trainer, self.eval_groups)


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory, ray_local):
    strategy = AsyncRolloutStrategy(max_staleness=1, max_inflight=2)
    logger = CompletionLogger(every_n_steps=2, num_prompts=1, max_chars=300)
    rows = FirstRows(logger)
    trainer, module, _ = fit_tiny(
        tmp_path_factory.mktemp("completions"), max_steps=4, strategy=strategy, extra_callbacks=[logger, rows]
    )
    yield trainer, module, rows, read_texts(trainer.log_dir)
    strategy.shutdown()


def test_training_completions_are_a_text_table_with_prompt_completion_and_reward(logged_run):
    _, module, rows, texts = logged_run
    tables = texts["rollout/completions/text_summary"]
    assert [step for step, _ in tables] == [
        2,
        4,
    ]
    step_4 = tables[-1][1]
    first = rows.rows[3]  # the 4th RL step's batch
    header = step_4.splitlines()[0]
    assert header == "| prompt | completion | reward | advantage | staleness | finish |"
    assert first["prompt"] in step_4
    assert f"| {first['reward']:.3f} |" in step_4
    first_row = step_4.splitlines()[2]
    assert first_row.split(" | ")[1] == first["completion"].replace("\n", " ⏎ ")
    assert first_row.rstrip(" |").rsplit(" | ", 1)[-1] in ("stop", "length")
    assert len(step_4.splitlines()) == 2 + module.num_generations  # one prompt, its group


def test_eval_completions_are_logged_under_their_own_tag(logged_run):
    _, _, rows, texts = logged_run
    table = texts["eval/completions/text_summary"][-1][1]
    rollout = rows.eval_groups[0][0]
    assert rollout.prompt.splitlines()[0] in table
    assert f"{rollout.reward:.3f}" in table and rollout.finish_reason in table
