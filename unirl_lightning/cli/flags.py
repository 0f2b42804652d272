"""Lightning's Trainer flags and callbacks against the RL modules: those they cannot honour are refused at
parse time naming the key and this library's equivalent (exit 2). ``docs/lightning.md`` has the whole
conformance table."""

from __future__ import annotations

from typing import Any

__all__ = [
    "REFUSED_CALLBACKS",
    "REFUSED_FLAGS",
    "refuse_cli_optimizers",
    "refuse_trainer_flags",
]

EVAL_CADENCE = "trainer.callbacks: RolloutEvalCallback(every_n_steps=N) (RL steps between evaluations)"

# Lightning flags and callbacks the RL modules cannot honour, with this library's equivalent. The modules
# step their optimizer themselves (manual optimization), so Lightning's gradient accumulation and clipping
# never apply; held-out evaluation is RolloutEvalCallback's (generation on the rollout workers), not
# Lightning's validation loop (the recipes set limit_val_batches: 0), so its cadence flags would do nothing.
REFUSED_FLAGS = {
    "accumulate_grad_batches": (
        (None, 1),
        "the RL modules accumulate a step's gradients over its micro-batches themselves: set "
        "model.init_args.micro_batch_rows or model.init_args.micro_batch_tokens (the rows or tokens of one "
        "forward/backward), and model.init_args.mini_batches for several updates per step",
    ),
    "gradient_clip_val": (
        (None, 0, 0.0),
        "the RL modules clip their gradients themselves: set model.init_args.max_grad_norm (by norm; 0 = off)",
    ),
    "gradient_clip_algorithm": (
        (None, "norm"),
        "the RL modules clip by norm only: set model.init_args.max_grad_norm",
    ),
    "val_check_interval": (
        (None, 1, 1.0),
        f"held-out evaluation runs on the rollout workers, not in Lightning's validation loop: set {EVAL_CADENCE}",
    ),
    "check_val_every_n_epoch": (
        (None, 1),
        f"held-out evaluation runs on the rollout workers, not in Lightning's validation loop: set {EVAL_CADENCE}",
    ),
    "num_sanity_val_steps": (
        (None, 0),
        "the sanity check of held-out evaluation is RolloutEvalCallback(eval_on_start=True) (the default): "
        "it evaluates the initial weights before the first step",
    ),
}

REFUSED_CALLBACKS = {
    "StochasticWeightAveraging": "it needs automatic optimization; the RL modules step their optimizer themselves "
    "(keep a moving average of the policy in a callback of your own, or lower model.init_args.lr late with "
    "model.init_args.lr_schedule)",
    "GradientAccumulationScheduler": "the RL modules accumulate over micro-batches themselves: set "
    "model.init_args.micro_batch_rows or model.init_args.micro_batch_tokens",
}


def refuse_trainer_flags(config: Any) -> None:
    """Lightning flags and callbacks the RL modules cannot honour (:data:`REFUSED_FLAGS`,
    :data:`REFUSED_CALLBACKS`), refused at parse time naming the key and this library's equivalent."""
    trainer = config.get("trainer") if hasattr(config, "get") else None
    if not hasattr(trainer, "get"):
        return
    for key, (allowed, equivalent) in REFUSED_FLAGS.items():
        value = trainer.get(key)
        if value not in allowed:
            raise ValueError(f"trainer.{key}={value}: {equivalent}")
    for index, callback in enumerate(trainer.get("callbacks") or []):
        class_path = (
            str(callback.get("class_path") or "") if hasattr(callback, "get") else type(callback).__name__
        )
        name = class_path.rpartition(".")[2]
        if name in REFUSED_CALLBACKS:
            raise ValueError(f"trainer.callbacks.{index} ({name}) cannot be used: {REFUSED_CALLBACKS[name]}")


def refuse_cli_optimizers(config: Any) -> None:
    """LightningCLI's ``--optimizer`` / ``--lr_scheduler`` would replace the module's own AdamW (fp32
    masters, fused) and schedule; refuse them naming the module's keys."""
    if config.get("optimizer") is not None:
        raise ValueError(
            "--optimizer is not used by the RL modules (their AdamW keeps fp32 masters and is fused where it "
            "can be): set model.init_args.lr, model.init_args.weight_decay and model.init_args.betas"
        )
    if config.get("lr_scheduler") is not None:
        raise ValueError(
            "--lr_scheduler is not used by the RL modules: set model.init_args.lr_schedule (one of "
            "'constant', 'linear', 'cosine') and model.init_args.warmup_steps (RL steps)"
        )
