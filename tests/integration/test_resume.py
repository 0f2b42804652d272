"""Kill-and-resume: no prompt is lost or trained twice, and the staleness bound holds after resume."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.builders import StepRecorder, tiny_module
from unirl_lightning.callbacks import WeightSyncCallback
from unirl_lightning.data import PromptDataModule
from unirl_lightning.strategy import AsyncRolloutStrategy

pytestmark = pytest.mark.usefixtures("ray_local")


class PromptRecorder(StepRecorder):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        tok = pl_module.tokenizer
        prompts = set()
        for ids, attn, resp in zip(batch.input_ids, batch.attention_mask, batch.response_mask):
            prompts.add(tok.decode(ids[(attn == 1) & (resp == 0)].tolist()))
        self.steps[-1]["prompts"] = prompts


def unique_prompts() -> PromptDataModule:
    """Unique prompts: 6 random digits in front of the digit to answer, in order."""
    return PromptDataModule(
        train="digit_successor",
        batch_size=4,
        num_train_prompts=400,
        task_kwargs={"prefix_len": 6},
        shuffle=False,
    )


def run(tmp_path, max_steps, ckpt_path=None, launch_unit="request"):
    seed_everything(0)
    recorder = PromptRecorder()
    strategy = AsyncRolloutStrategy(max_staleness=1, max_inflight=2, launch_unit=launch_unit)
    trainer = Trainer(
        strategy=strategy,
        max_steps=max_steps,
        callbacks=[
            WeightSyncCallback(),
            recorder,
            ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_last=True),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(tiny_module(), datamodule=unique_prompts(), ckpt_path=ckpt_path)
    loop = strategy.runtime.loop
    # drawn but not trained, as the loop would save it for the next resume: launched (in flight or
    # buffered), queued for relaunch by this resume, or drawn and not yet launched (groups)
    saved = loop.loop_state()
    leftover = {r["prompt"] for records in saved["untrained"] for r in records}
    leftover |= {r["prompt"] for r in saved["pending_records"]}
    strategy.shutdown()
    return recorder, leftover, loop


@pytest.mark.parametrize("launch_unit", ["request", "group"])
def test_kill_and_resume_loses_and_repeats_no_prompt(tmp_path, launch_unit):
    """Stopped after 4 steps with work in flight (with ``launch_unit="group"``: single groups launched,
    some of the drawn batch not yet launched), resumed to 8: no prompt trained twice, and the prompts
    trained or still held form an unbroken prefix of the (unshuffled) stream: none was lost."""
    first, _, loop1 = run(tmp_path, max_steps=4, launch_unit=launch_unit)
    if launch_unit == "group":
        assert loop1.groups_per_step == 4 and loop1.untrained, "the first run stopped with groups in flight"
    ckpt = str(tmp_path / "ckpt" / "last.ckpt")
    second, leftover, loop2 = run(tmp_path, max_steps=8, ckpt_path=ckpt, launch_unit=launch_unit)
    assert len(first.steps) == 4 and len(second.steps) == 4
    trained = [p for s in first.steps + second.steps for p in s["prompts"]]
    assert len(trained) == len(set(trained)), "a prompt was trained twice across the resume"
    assert not set(trained) & leftover
    order = [r["prompt"] for r in unique_prompts().train_records()]
    held = set(trained) | leftover
    reached = max(order.index(p) for p in held)
    assert set(order[: reached + 1]) == held, "a prompt drawn before the stop was neither trained nor kept"
    # the resumed run continued the version ledger and re-pushed once at start: version 4 -> 5
    assert second.steps[0]["version"] == 5
    staleness = [s["version"] - v for s in second.steps for v in s["row_versions"]]
    assert max(staleness) <= 1
    # the first run's launched-but-untrained requests were relaunched first, not dropped
    assert loop2.evicted_groups == 0 and loop1.evicted_groups == 0


def fit_recording(tmp_path, strategy, data, max_steps, ckpt_path=None):
    seed_everything(0)
    recorder = PromptRecorder()
    trainer = Trainer(
        strategy=strategy,
        max_steps=max_steps,
        callbacks=[
            WeightSyncCallback(),
            recorder,
            ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_last=True),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(tiny_module(), datamodule=data, ckpt_path=ckpt_path)
    loop = strategy.runtime.loop
    strategy.shutdown()
    return recorder, loop


def test_a_resume_in_the_third_pass_of_a_shuffled_dataset_trains_each_prompt_of_each_pass_once(tmp_path):
    """On-policy (one request per step, trained in order), so step ``s`` trains batch ``s``: 12 unique
    prompts in 3 batches a pass, killed one batch into the third pass and resumed to its end."""

    def data():
        return PromptDataModule(
            train="digit_successor", batch_size=4, num_train_prompts=12, task_kwargs={"prefix_len": 6}
        )

    def strategy():
        return AsyncRolloutStrategy(max_staleness=0, max_inflight=1)

    first, _ = fit_recording(tmp_path, strategy(), data(), max_steps=7)
    ckpt = str(tmp_path / "ckpt" / "last.ckpt")
    second, loop = fit_recording(tmp_path, strategy(), data(), max_steps=9, ckpt_path=ckpt)
    steps = [s["prompts"] for s in first.steps + second.steps]
    assert len(first.steps) == 7 and len(second.steps) == 2 and all(len(s) == 4 for s in steps)
    passes = [[p for s in steps[k : k + 3] for p in s] for k in (0, 3, 6)]
    for number, trained in enumerate(passes):
        assert len(trained) == len(set(trained)) == 12, f"pass {number} trained a prompt twice or missed one"
        assert set(trained) == set(passes[0])
    assert steps[6:9] != steps[0:3], "the passes should be shuffled differently"
    assert loop.stream.position() == {"prompt_batches_used": 9, "prompt_epoch": 2, "epoch_start": 6}
