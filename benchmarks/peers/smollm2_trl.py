"""TRL's side of ``smollm2_learning.py``: ``GRPOTrainer`` built from the SAME parsed recipe as ours (the
module the CLI instantiates gives the model with its LoRA adapters, the tokenizer, the reward and the
sampling settings; the datamodule the records), with a held-out evaluation callback that applies the
recipe's rule. A helper module (no ``main``); TRL, ``datasets`` and the library are imported inside
:func:`child_trl`.
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import time
from typing import Any

from benchmarks.peers import trl_side

TRL_SCALE_REWARDS = {"grpo": "group", "dr_grpo": "none"}  # our advantage -> TRL's scale_rewards


def child_trl(cfg: dict[str, Any], recipe_args: list[str], start: float) -> dict[str, Any]:
    """TRL's run of the recipe parsed from ``recipe_args`` (``--config ... --seed_everything ...``),
    evaluated at step 0 and every ``every_n_steps``; times from ``start`` (the process's clock)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from unirl_lightning.cli.app import UniRLCLI
    from unirl_lightning.core.prompts import render_prompt_text
    from unirl_lightning.rewards.scoring import score_parts

    with tempfile.TemporaryDirectory(prefix="smollm2-trl-") as out:
        os.chdir(out)  # the parsed recipe's logger and checkpoint folders land here, unused
        cli = UniRLCLI(args=recipe_args, run=False)
        module, data = cli.model, cli.datamodule
        (evaluator,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "RolloutEvalCallback"]
        tokenizer, sampling = module.tokenizer, module.sampling
        train = [dict(r) for r in data.train_records()]
        if cfg["name"] == "trl-same-order":  # our stream's first pass, in order (unshuffled below)
            loader = data.train_dataloader()
            loader.sampler.set_epoch(0)
            train = [dict(r) for batch in loader for r in batch]
        held_out = [dict(r) for r in data.val_records()][: evaluator.num_prompts]
        system = module.policy_spec.system_prompt
        head = [{"role": "system", "content": system}] if system else []
        # each row carries its whole record (JSON: reasoning-gym's entry has nested, uneven metadata)
        rows = [
            {"prompt": [*head, {"role": "user", "content": r["prompt"]}], "record": json.dumps(r)}
            for r in train
        ]
        parts_log: list[dict[str, float]] = []

        def reward(completions: list, record: list, **_: Any) -> list[float]:
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            records = [json.loads(r) for r in record]
            total, parts = score_parts(module.reward, texts, records)
            parts_log.append({k: sum(x or 0.0 for x in v) / len(v) for k, v in parts.items()})
            return total

        reward.__name__ = "recipe_reward"
        evals: list[dict[str, Any]] = []
        stop_ids = list(module.policy_spec.stop_ids(tokenizer))

        def evaluate(model: Any, step: int) -> None:
            texts = [render_prompt_text(tokenizer, r, chat=True, system_prompt=system) for r in held_out]
            was_training = model.training
            model.eval()
            side, tokenizer.padding_side = tokenizer.padding_side, "left"
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            tokenizer.padding_side = side
            with torch.no_grad():
                ids = model.generate(
                    **batch,
                    max_new_tokens=sampling.max_new_tokens,
                    do_sample=False,
                    eos_token_id=stop_ids,
                    pad_token_id=tokenizer.pad_token_id,
                )
            completions = tokenizer.batch_decode(
                ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
            )
            scores = module.reward(completions, held_out)
            accuracy = sum(s >= evaluator.accuracy_threshold for s in scores) / len(scores)
            common_answers = collections.Counter(c.strip()[:60] for c in completions).most_common(3)
            evals.append(
                {
                    "step": step,
                    "t": round(time.perf_counter() - start, 1),
                    "heldout_accuracy": accuracy,
                    "most_common_completions": common_answers,  # what a format-only collapse looks like
                }
            )
            model.train(was_training)

        class Eval(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN201
                evaluate(model, 0)

            def on_step_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN201
                if state.global_step % evaluator.every_n_steps == 0 or state.global_step == args.max_steps:
                    evaluate(model, state.global_step)

        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=data.batch_size * module.num_generations,
            gradient_accumulation_steps=1,
            num_generations=module.num_generations,
            max_completion_length=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            learning_rate=module.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=module.weight_decay,
            adam_beta1=module.betas[0],
            adam_beta2=module.betas[1],
            max_grad_norm=module.max_grad_norm,
            beta=module.kl_coef,
            epsilon=module.loss_settings.clip_low,
            loss_type="dapo",
            disable_dropout=True,
            # GRPOConfig's defaults are True for both; the recipe trains in float32 and does not checkpoint
            bf16=cfg["name"] == "trl-grpo-defaults",
            gradient_checkpointing=cfg["name"] == "trl-grpo-defaults",
            scale_rewards=TRL_SCALE_REWARDS[module.advantage],
            use_cpu=True,
            report_to="none",
            logging_steps=1_000_000,
            save_strategy="no",
            disable_tqdm=True,
            max_steps=cfg["steps"],
            seed=cfg["seed"],
            data_seed=cfg["seed"],
            shuffle_dataset=cfg["name"] != "trl-same-order",
            dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(
            model=module.policy,  # the recipe's SmolLM2 with its peft LoRA adapters
            reward_funcs=reward,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[Eval()],
        )
        trainer.train()
    names = sorted({k for p in parts_log for k in p})
    per_step = {f"rollout/reward/{n}_mean": [round(p.get(n, 0.0), 4) for p in parts_log] for n in names}
    return {
        "evals": evals,
        "train_rewards": per_step,
        "torch_threads": torch.get_num_threads(),
        "trl": trl_side.trl_version(),
    }
