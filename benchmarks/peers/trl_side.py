"""TRL's side of the comparisons (``vs_trl.py``, ``time_to_accuracy.py``, ``smollm2_learning.py``).

* :func:`make_trl_trainer`: TRL's ``GRPOTrainer`` on a saved model (HF generation, fp32 on CPU,
  ``beta=0``, one optimizer step per generation, constant lr), counting the completion tokens it
  generates and timing its generation;
* :func:`check_trl_counted`: fail loudly when TRL's internals moved and the counting hooks never ran;
* :func:`timed_run`: ``vs_trl.py``'s TRL configurations, timed;
* :func:`trl_version`.

A helper module (no ``main``). TRL, ``datasets`` and transformers are imported inside the functions:
``pip install -e '.[bench]'`` (``trl>=1.16,<1.17``); the counting hooks are TRL 1.16's generation
internals.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import sides


def make_trl_trainer(
    model_dir: str | Path,
    records: list[dict],
    *,
    prompts_per_step: int,
    group: int,
    max_new_tokens: int,
    lr: float,
    seed: int,
    max_steps: int,
    suppress_eos: bool,
    output_dir: str | Path,
    callbacks: list | None = None,
    reward: Any = sides.first_char_reward,
    gradient_checkpointing: bool = False,
) -> Any:
    """TRL ``GRPOTrainer``: HF generation, fp32 on CPU, ``beta=0``, one generation per optimizer step
    (``per_device_train_batch_size = prompts x samples``), constant lr, no logging backend.
    ``gradient_checkpointing`` is off (TRL's default is on: it would recompute activations in every
    backward while ours does not, so every speed comparison turns it off; ``True`` = TRL's default)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    class CountingGRPOTrainer(GRPOTrainer):
        """Counts the completion tokens of every generation and times it (what TRL does per step)."""

        prompt_tokens: list[int]
        completion_tokens: list[int]
        generate_s: list[float]
        prepare_s: list[float]

        def _generate(self, prompts: list):  # noqa: ANN202 - TRL's signature
            out = super()._generate(prompts)
            self.prompt_tokens.append(sum(len(ids) for ids in out[0]))
            self.completion_tokens.append(sum(len(ids) for ids in out[1]))
            return out

        def _generate_single_turn(self, *args: Any, **kwargs: Any):  # noqa: ANN202
            start = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            self.generate_s.append(time.perf_counter() - start)
            return out

        def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.prepare_s.append(time.perf_counter() - start)
            return out

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # the saved generation config's list (several end tokens for a real model), else the tokenizer's EOS
    suppressed = model.generation_config.suppress_tokens or [tokenizer.eos_token_id]
    generation_kwargs = {"suppress_tokens": list(suppressed)} if suppress_eos else None
    args = GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=prompts_per_step * group,
        gradient_accumulation_steps=1,
        num_generations=group,
        max_completion_length=max_new_tokens,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        temperature=1.0,
        top_p=1.0,
        bf16=False,
        fp16=False,
        use_cpu=True,
        report_to="none",
        logging_steps=1_000_000,
        save_strategy="no",
        disable_tqdm=True,
        max_steps=max_steps,
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        generation_kwargs=generation_kwargs,
        gradient_checkpointing=gradient_checkpointing,
    )
    trainer = CountingGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(records),
        processing_class=tokenizer,
        callbacks=callbacks or [],
    )
    trainer.prompt_tokens, trainer.completion_tokens, trainer.generate_s, trainer.prepare_s = [], [], [], []
    return trainer


def check_trl_counted(trainer: Any) -> None:
    """Fail loudly if TRL's internals moved and the token counting hooks never ran."""
    if not trainer.completion_tokens or not trainer.generate_s:
        raise RuntimeError(
            f"TRL {trl_version()}: GRPOTrainer._generate / _generate_single_turn were not called, so the "
            "generated tokens were not counted; these benchmarks hook TRL 1.16's internals (pip install 'trl>=1.16,<1.17')"
        )


def trl_version() -> str:
    try:
        import trl

        return trl.__version__
    except ImportError:
        return "not installed"


def timing(stamps: list[float], warmup: int) -> tuple[int, float]:
    """Steps and seconds from the end of the last warm-up step to the end of the last step."""
    steps = len(stamps) - warmup
    return steps, stamps[-1] - stamps[warmup - 1]


def timed_run(cfg: dict[str, Any]) -> dict[str, Any]:
    """``vs_trl.py``'s TRL configuration (``trl-1t`` / ``trl-2t``): ``GRPOTrainer`` on the workload of
    ``cfg``, timed after ``cfg["warmup"]`` steps, its generated tokens counted."""
    import torch
    from transformers import TrainerCallback

    from unirl_lightning.data.tasks import make_task

    torch.set_num_threads(cfg["threads"])

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            self.stamps.append(time.perf_counter())

    clock = Clock()
    records = make_task("digit_successor", 1024, cfg["seed"], prefix_len=cfg.get("prefix_len", 8))
    with tempfile.TemporaryDirectory(prefix="trl-") as out:
        trainer = make_trl_trainer(
            cfg["model_dir"],
            records,
            prompts_per_step=cfg["prompts"],
            group=cfg["group"],
            max_new_tokens=cfg["max_new_tokens"],
            lr=cfg["lr"],
            seed=cfg["seed"],
            max_steps=cfg["warmup"] + cfg["steps"],
            suppress_eos=cfg["suppress_eos"],
            output_dir=out,
            callbacks=[clock],
            gradient_checkpointing=cfg.get("gradient_checkpointing", False),
        )
        trainer.train()
    check_trl_counted(trainer)
    steps, seconds = timing(clock.stamps, cfg["warmup"])
    w = cfg["warmup"]
    tokens = trainer.completion_tokens[w:]
    return {
        "steps": steps,
        "seconds": seconds,
        "steps_per_s": steps / seconds,
        "completions_per_s": steps * cfg["prompts"] * cfg["group"] / seconds,
        "tokens_per_s": sum(tokens) / seconds,
        "tokens_per_step": sorted(set(tokens)),
        "prompt_tokens_per_step": sorted(set(trainer.prompt_tokens[w:])),
        "generate_s": sum(trainer.generate_s[w:]) / steps,
        "prepare_s": sum(trainer.prepare_s[w:]) / steps,  # generate + score + advantages (+ old log-probs)
        "train_s": seconds / steps - sum(trainer.prepare_s[w:]) / steps,  # the rest of the step
        "torch_threads": torch.get_num_threads(),
        "trl": trl_version(),
    }
