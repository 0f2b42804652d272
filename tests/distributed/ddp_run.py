"""A GRPO run on 2 DDP or FSDP training ranks (CPU, gloo) with one rollout worker per rank, as a script: the
tests run it in a subprocess (Lightning's DDP launcher re-runs this script for rank 1) and read the
``rank<r>.json`` file each rank writes: every step's version, row versions, gen_ids, prompts and
metrics, a checksum of the trained weights and of what each worker serves, whether the workers hold
them bit for bit, the workers' pids and whether the rank imported Ray.

    python tests/distributed/ddp_run.py --out DIR --mode sync|async --max-steps N [--ckpt PATH]
        [--parallel ddp|fsdp] [--sharded-checkpoint] [--weight-sync object_store|collective|inprocess]
        [--placement separate|hybrid]
        [--timeout-s S] [--kill-worker-rank R --kill-at-step K] [--raise-rank R --raise-at-step K]
        [--raise-reward-rank R --raise-at-call K]

Faults: ``--kill-worker-rank R --kill-at-step K`` SIGKILLs rank R's rollout worker at the start of
RL step K (a request is in flight in async mode); ``--raise-rank R --raise-at-step K`` raises inside
rank R's training step K (the run fails; nothing is written); ``--raise-reward-rank R --raise-at-call K``
raises in the reward of rank R's rollout worker at its K-th call.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "token")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tests.* and the package

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from tests.builders import tiny_module  # noqa: E402
from tests.distributed.faults import FailingReward  # noqa: E402
from unirl_lightning.callbacks import WeightSyncCallback, WeightVersionLogger  # noqa: E402
from unirl_lightning.data import PromptDataModule  # noqa: E402
from unirl_lightning.distributed.sharding import full_tensor, local_numel  # noqa: E402
from unirl_lightning.models.lora import LoraSpec  # noqa: E402
from unirl_lightning.strategy import AsyncRolloutDDPStrategy, AsyncRolloutFSDPStrategy  # noqa: E402


class Record(Callback):
    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        tok = pl_module.tokenizer
        prompts = sorted(
            {
                tok.decode(ids[(attn == 1) & (resp == 0)].tolist())
                for ids, attn, resp in zip(batch.input_ids, batch.attention_mask, batch.response_mask)
            }
        )
        self.steps.append(
            {
                "version": trainer.strategy.weight_version,
                "row_versions": batch.weight_versions.tolist(),
                "gen_ids": sorted(set(batch.gen_ids.tolist())),
                "prompts": prompts,
            }
        )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        mine = pl_module.last_step_metrics  # this rank's, not the mean over ranks
        self.steps[-1]["ratio_mean"] = float(mine["ratio_mean"])
        self.steps[-1]["logp_diff_abs"] = float(mine["logp_diff_abs"])
        self.steps[-1]["worker_restarts"] = trainer.strategy.runtime.stats()["rollout/worker_restarts"]

    def on_train_start(self, trainer, pl_module):  # after a resume has restored the weights
        self.workers_equal_at_start = workers_hold(trainer, whole_state(pl_module))

    def on_train_end(self, trainer, pl_module):  # before the strategy stops the workers
        strategy = trainer.strategy
        trainer_state = whole_state(pl_module)
        held, total = local_numel(pl_module.policy)
        loop = strategy.runtime.loop
        self.final = {
            "rank": trainer.global_rank,
            "steps": self.steps,
            "checksum": checksum(trainer_state),
            "held_fraction": held / total,
            "workers_equal_at_start": self.workers_equal_at_start,
            "workers_equal": workers_hold(trainer, trainer_state),
            "worker_checksums": worker_checksums(trainer),
            "worker_pids": [w["pid"] for w in strategy.runtime.workers.call("placement_info")],
            "pid": os.getpid(),
            "ray_imported": "ray" in sys.modules,
            "next_gen_id": loop.controller.next_gen_id,
            "untrained": sorted(loop.untrained),
            "evicted": list(loop.recent_evicted_gen_ids),
            "untrained_prompts": sorted(r["prompt"] for records in loop.untrained.values() for r in records),
        }


def worker_pid(worker, *_):
    return os.getpid()


class KillWorker(Callback):
    """SIGKILLs rollout worker 0 of rank ``rank`` at the start of RL step ``at_step``."""

    def __init__(self, rank: int, at_step: int) -> None:
        self.rank, self.at_step = rank, at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and batch_idx == self.at_step:
            import ray

            os.kill(
                ray.get(trainer.strategy.runtime.workers.workers[0].run.remote(worker_pid)), signal.SIGKILL
            )


def raise_in_training_step(module, rank: int, at_step: int, out: Path) -> None:
    """Make ``module``'s training step ``at_step`` raise on rank ``rank`` (the other ranks go on);
    the time of the raise goes to ``out/raised_at``."""
    training_step = module.training_step

    def failing_step(batch, batch_idx, *args, **kwargs):
        if module.global_rank == rank and batch_idx == at_step:
            (out / "raised_at").write_text(repr(time.time()))
            raise RuntimeError(f"injected failure on rank {rank} at step {at_step}")
        return training_step(batch, batch_idx, *args, **kwargs)

    module.training_step = failing_step


def whole_state(pl_module) -> dict:
    """The policy's tensors whole (a sharded policy is gathered: every rank runs this, in the same order)."""
    return {k: full_tensor(v) for k, v in pl_module.policy.state_dict().items()}


def workers_hold(trainer, state: dict) -> bool | None:
    """Whether every rollout worker of this rank holds ``state`` bit for bit (None with LoRA: the
    workers hold the merged weights under other names; the on-policy pin checks them)."""
    if trainer.lightning_module.lora is not None:
        return None
    return all(
        all(torch.equal(worker[k], v) for k, v in state.items())
        for worker in trainer.strategy.runtime.workers.call("state_dict")
    )


def worker_checksums(trainer) -> list[str] | None:
    """The checksum of what each rollout worker of this rank serves (None with LoRA, as above)."""
    if trainer.lightning_module.lora is not None:
        return None
    return [checksum(worker) for worker in trainer.strategy.runtime.workers.call("state_dict")]


def checksum(state: dict) -> str:
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode() + state[name].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["sync", "async"], required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--sharded-checkpoint", action="store_true", help="FSDP: a folder of shards")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0 = full fine-tuning)")
    parser.add_argument(
        "--weight-sync", choices=["object_store", "collective", "inprocess"], default="object_store"
    )
    parser.add_argument("--placement", choices=["separate", "hybrid"], default="separate")
    parser.add_argument(
        "--streaming",
        action="store_true",
        help="group launches into a continuous HF engine, sync_mode continue",
    )
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="the process group's timeout")
    parser.add_argument("--kill-worker-rank", type=int, default=None)
    parser.add_argument("--kill-at-step", type=int, default=2)
    parser.add_argument("--raise-rank", type=int, default=None)
    parser.add_argument("--raise-at-step", type=int, default=2)
    parser.add_argument("--raise-reward-rank", type=int, default=None)
    parser.add_argument("--raise-at-call", type=int, default=3)
    args = parser.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    seed_everything(0)
    staleness, inflight = (0, 1) if args.mode == "sync" else (1, 2)
    settings = dict(
        process_group_backend="gloo",
        max_staleness=staleness,
        max_inflight=inflight,
        num_workers=1,
        weight_sync=args.weight_sync,
        placement=args.placement,
        timeout_s=args.timeout_s,
    )
    if args.streaming:
        from unirl_lightning.engines.hf import HFEngineConfig

        settings.update(
            launch_unit="group",
            sync_mode="continue",
            engine=HFEngineConfig(device="cpu", num_threads=1, batching="continuous", max_batch_size=32),
        )
    if args.parallel == "fsdp" and args.weight_sync == "collective":
        settings["max_worker_restarts"] = 0  # a replacement under FSDP needs object_store (it re-sends)
    if args.parallel == "ddp":
        strategy = AsyncRolloutDDPStrategy(**settings)
    else:
        strategy = AsyncRolloutFSDPStrategy(save_distributed_checkpoint=args.sharded_checkpoint, **settings)
    record = Record()
    faults = [] if args.kill_worker_rank is None else [KillWorker(args.kill_worker_rank, args.kill_at_step)]
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.max_steps,
        callbacks=[
            WeightSyncCallback(),
            WeightVersionLogger(histogram_every_n_steps=0),
            record,
            ModelCheckpoint(out / "ckpt", every_n_train_steps=1, save_last=True),
            *faults,
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = tiny_module(lora=LoraSpec(rank=args.lora) if args.lora else None)
    if args.raise_rank is not None:
        raise_in_training_step(module, args.raise_rank, args.raise_at_step, out)
    if args.raise_reward_rank is not None:
        module.reward = FailingReward(args.raise_reward_rank, args.raise_at_call, str(out))
    data = PromptDataModule(
        train="digit_successor",
        batch_size=4,
        num_train_prompts=400,
        task_kwargs={"prefix_len": 6},
        shuffle=False,
    )
    trainer.fit(module, datamodule=data, ckpt_path=args.ckpt)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record.final))


if __name__ == "__main__":
    main()
