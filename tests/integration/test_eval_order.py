"""An evaluation at RL step k scores the weights after k updates, whatever the callbacks' order: the
evaluation listed before the weight-sync callback, after it, or with the sync callback left to the
module (which appends it after the trainer's callbacks, as the SmolLM2 recipe does)."""

from __future__ import annotations

import pytest
from lightning.pytorch import seed_everything

from tests.builders import make_trainer, tiny_module
from unirl_lightning.callbacks import RolloutEvalCallback, WeightSyncCallback
from unirl_lightning.data import PromptDataModule
from unirl_lightning.strategy import AsyncRolloutStrategy

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.mark.parametrize("order", ["eval_first", "sync_first", "sync_from_module"])
def test_an_evaluation_at_step_k_scores_the_weights_after_k_updates(tmp_path, order):
    seed_everything(0)
    evaluator = RolloutEvalCallback(every_n_steps=5, num_prompts=4)
    callbacks = {
        "eval_first": [evaluator, WeightSyncCallback()],
        "sync_first": [WeightSyncCallback(), evaluator],
        "sync_from_module": [evaluator],
    }[order]
    strategy = AsyncRolloutStrategy(max_staleness=1, max_inflight=2)
    trainer = make_trainer(tmp_path, strategy, 10, callbacks)
    data = PromptDataModule(train="digit_successor", batch_size=4, num_train_prompts=64, num_val_prompts=4)
    try:
        trainer.fit(tiny_module(), datamodule=data)
        history = [(h["step"], h["eval/weight_version"], h["eval/weights_step"]) for h in evaluator.history]
        # the start, then steps 5 and 10 after their pushes; step 10 is the last, so no extra end evaluation
        assert history == [(0.0, 0.0, 0.0), (5.0, 5.0, 5.0), (10.0, 10.0, 10.0)]
        assert strategy.weight_version == 10  # one push per step: the evaluation added none
    finally:
        strategy.shutdown()


def test_the_end_evaluation_scores_the_final_weights_when_no_push_was_due(tmp_path):
    seed_everything(0)
    evaluator = RolloutEvalCallback(every_n_steps=4, num_prompts=4)
    strategy = AsyncRolloutStrategy(max_staleness=2, max_inflight=2)
    trainer = make_trainer(tmp_path, strategy, 5, [evaluator, WeightSyncCallback(every_n_steps=2)])
    data = PromptDataModule(train="digit_successor", batch_size=4, num_train_prompts=64, num_val_prompts=4)
    try:
        trainer.fit(tiny_module(), datamodule=data)
        steps = [(h["step"], h["eval/weights_step"]) for h in evaluator.history]
        # step 4's push (due every 2 steps), then at the end step 5's update pushed and scored
        assert steps == [(0.0, 0.0), (4.0, 4.0), (5.0, 5.0)]
        assert evaluator.history[-1]["eval/weight_version"] == 3.0  # pushes at steps 2, 4 and the end
    finally:
        strategy.shutdown()
