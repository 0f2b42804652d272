"""One run of ``time_to_accuracy.py`` (a child process): the training clock with its weight snapshots,
the two sides trained on it, and the greedy evaluation of every snapshot afterwards. A helper module
(no ``main``)."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import sides
from benchmarks.peers import trl_side


class Snapshots:
    """The training clock (snapshot copies excluded) and the weight snapshots taken on it."""

    def __init__(self, every_s: float, budget_s: float, samples_per_step: int) -> None:
        self.every_s = every_s
        self.budget_s = budget_s
        self.samples_per_step = samples_per_step
        self.start: float | None = None
        self.paused = 0.0
        self.steps = 0
        self.window: list[float] = []
        self.points: list[dict[str, Any]] = []
        self.next_at = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start - self.paused

    def begin(self, model: Any) -> None:
        self.start = time.perf_counter()
        self.take(model, force=True)

    def take(self, model: Any, force: bool = False) -> None:
        now = self.elapsed()
        if not force and now < self.next_at:
            return
        paused = time.perf_counter()
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        window = self.window
        self.points.append(
            {
                "t": now,
                "step": self.steps,
                "samples": self.steps * self.samples_per_step,
                "train_reward": sum(window) / len(window) if window else None,  # mean since the last snapshot
                "state": state,
            }
        )
        self.window = []
        self.next_at = (int(now / self.every_s) + 1) * self.every_s
        self.paused += time.perf_counter() - paused

    def step_end(self, model: Any, reward: float | None) -> bool:
        """Count a step; snapshot when due; True once the budget is spent (a last snapshot taken)."""
        self.steps += 1
        if reward is not None:
            self.window.append(reward)
        if self.elapsed() >= self.budget_s:
            self.take(model, force=True)
            return True
        self.take(model)
        return False


def evaluate_snapshots(
    snapshots: Snapshots, model_dir: str, held_out: list[dict], train: list[dict], max_new_tokens: int
) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    curve = []
    for point in snapshots.points:
        model.load_state_dict(point.pop("state"))
        point["heldout_accuracy"] = sides.greedy_accuracy(model, tokenizer, held_out, max_new_tokens)
        point["train_accuracy"] = sides.greedy_accuracy(model, tokenizer, train, max_new_tokens)
        curve.append({k: (round(v, 4) if isinstance(v, float) else v) for k, v in point.items()})
    return curve


def train_trl(cfg: dict[str, Any], train: list[dict], snapshots: Snapshots) -> dict[str, Any]:
    """TRL's ``GRPOTrainer`` until the budget is spent, snapshotting on the clock."""
    import torch
    from transformers import TrainerCallback

    torch.set_num_threads(cfg["trl_threads"])
    last_reward: list[float] = []

    def reward(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float]:
        scores = sides.first_char_reward(prompts, completions, answer, **kwargs)
        last_reward.append(sum(scores) / len(scores))
        return scores

    reward.__name__ = "first_char"

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN201
            snapshots.begin(model)

        def on_step_end(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN201
            if snapshots.step_end(model, last_reward[-1] if last_reward else None):
                control.should_training_stop = True

    with tempfile.TemporaryDirectory(prefix="trl-") as out:
        trainer = trl_side.make_trl_trainer(
            cfg["model_dir"],
            train,
            prompts_per_step=cfg["prompts"],
            group=cfg["group"],
            max_new_tokens=cfg["max_new_tokens"],
            lr=cfg["lr"],
            seed=cfg["seed"],
            max_steps=10**7,
            suppress_eos=False,
            output_dir=out,
            callbacks=[Clock()],
            reward=reward,
        )
        trainer.train()
    trl_side.check_trl_counted(trainer)
    tokens = trainer.completion_tokens
    return {
        "torch_threads": torch.get_num_threads(),
        "trl": trl_side.trl_version(),
        "completion_tokens_per_step": sum(tokens) / max(1, len(tokens)),
    }


def train_ours(cfg: dict[str, Any], snapshots: Snapshots) -> dict[str, Any]:
    """Ours (one Ray rollout worker, 1 thread; the trainer on 1 thread) until the budget is spent."""
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything

    from unirl_lightning import AsyncRolloutStrategy, GRPOModule, PromptDataModule
    from unirl_lightning.engines.hf import HFEngineConfig
    from unirl_lightning.models.causal_lm import PretrainedCausalLM

    tokens: list[float] = []

    class Clock(Callback):
        def on_train_start(self, trainer, pl_module):  # noqa: ANN001, ANN201
            snapshots.begin(pl_module.policy)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001, ANN201
            tokens.append(batch.stats["rollout/completion_tokens"])
            if snapshots.step_end(pl_module.policy, float(batch.stats["rollout/reward_mean"])):
                trainer.should_stop = True

    seed_everything(cfg["seed"])
    strategy = AsyncRolloutStrategy(
        engine=HFEngineConfig(device="cpu", num_threads=1),
        max_staleness=cfg["max_staleness"],
        max_inflight=cfg["max_inflight"],
        num_workers=1,
        trainer_threads=1,
        seed=cfg["seed"],
    )
    module = GRPOModule(
        policy=PretrainedCausalLM(name_or_path=cfg["model_dir"], dtype="float32"),
        reward=sides.FirstCharReward(),
        num_generations=cfg["group"],
        max_new_tokens=cfg["max_new_tokens"],
        lr=cfg["lr"],
    )
    trainer = Trainer(
        strategy=strategy,
        max_steps=10**7,
        callbacks=[Clock()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    data = PromptDataModule(
        train=cfg["train_file"], val=cfg["val_file"], batch_size=cfg["prompts"], seed=cfg["seed"]
    )
    try:
        trainer.fit(module, datamodule=data)
    finally:
        strategy.shutdown()
    return {
        "torch_threads": torch.get_num_threads(),
        "completion_tokens_per_step": sum(tokens) / max(1, len(tokens)),
    }


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """One configuration and seed: train for the budget, then score every snapshot."""
    train = [json.loads(line) for line in Path(cfg["train_file"]).read_text().splitlines()]
    held_out = [json.loads(line) for line in Path(cfg["val_file"]).read_text().splitlines()]
    snapshots = Snapshots(cfg["snapshot_every_s"], cfg["budget_s"], cfg["prompts"] * cfg["group"])
    if cfg["side"] == "trl":
        extra = train_trl(cfg, train, snapshots)
    else:
        extra = train_ours(cfg, snapshots)
    train_s = snapshots.points[-1]["t"]
    steps = snapshots.steps
    curve = evaluate_snapshots(snapshots, cfg["model_dir"], held_out, train, cfg["max_new_tokens"])
    return {
        "name": cfg["name"],
        "seed": cfg["seed"],
        "steps": steps,
        "train_s": train_s,
        "steps_per_s": steps / train_s,
        "ms_per_step": 1e3 * train_s / steps,
        "curve": curve,
        **extra,
    }
