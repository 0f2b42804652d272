"""A GRPO fit on 2 DDP or FSDP training ranks (CPU, gloo, ``placement="hybrid"``: one engine inside each
rank, no Ray) that records what every rank holds before its first step, as a script: the tests run it in
a subprocess (Lightning's launcher re-runs it for rank 1, with ``LOCAL_RANK=1``) and read the
``rank<r>.json`` each rank writes: whether the rank built its networks on the meta device, a digest of
every tensor of the module's state dict and of every buffer (non-persistent ones included), gathered
whole under FSDP, right after ``configure_model`` (before DDP's wrapper syncs anything) and at fit
start (after the strategy's setup), and the checksum of the trained policy after the last step.

    python tests/distributed/rank0_load_run.py --out DIR [--parallel ddp|fsdp] [--lora RANK]
        [--kl-coef C] [--load-once-per-node 0|1] [--max-steps N] [--smollm2 float32|bfloat16]

:func:`tensor_digests` is also what the tests compute in one process for the expected values.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "token")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tests.* and the package

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402

from tests.builders import tiny_module  # noqa: E402
from unirl_lightning.callbacks import WeightSyncCallback, WeightVersionLogger  # noqa: E402
from unirl_lightning.data import PromptDataModule  # noqa: E402
from unirl_lightning.distributed.sharding import full_tensor  # noqa: E402
from unirl_lightning.models.lora import LoraSpec  # noqa: E402
from unirl_lightning.strategy import AsyncRolloutDDPStrategy, AsyncRolloutFSDPStrategy  # noqa: E402


def digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous()
    return hashlib.sha256(
        str(data.dtype).encode() + data.reshape(-1).view(torch.uint8).numpy().tobytes()
    ).hexdigest()[:16]


def tensor_digests(module: torch.nn.Module) -> dict[str, str]:
    """A digest of every state-dict tensor of ``module`` (sharded ones gathered whole: a collective,
    every rank runs it in the same order) and of every buffer, under ``buffer:<name>``."""
    digests = {name: digest(full_tensor(t)) for name, t in module.state_dict().items()}
    digests.update({f"buffer:{name}": digest(b) for name, b in module.named_buffers()})
    return digests


def module_for(lora: int, kl_coef: float, load_once_per_node: bool = True, smollm2_dtype: str | None = None):
    """The tiny GRPO module, or with ``smollm2_dtype`` SmolLM2-135M-Instruct (tied embedding; by hand)."""
    policy = {}
    if smollm2_dtype:
        from unirl_lightning.models.causal_lm import PretrainedCausalLM

        policy["policy"] = PretrainedCausalLM("smollm2-135m-instruct", dtype=smollm2_dtype, chat=True)
    return tiny_module(
        lora=LoraSpec(rank=lora, init_seed=0) if lora else None,
        kl_coef=kl_coef,
        load_once_per_node=load_once_per_node,
        **policy,
    )


class Record(Callback):
    after_configure_model: dict[str, str] = {}

    def on_fit_start(self, trainer, pl_module):  # configure_model and the strategy's setup have run
        self.at_start = tensor_digests(pl_module)

    def on_train_end(self, trainer, pl_module):
        trained = tensor_digests(pl_module.policy)
        self.final = {
            "rank": trainer.global_rank,
            "built_on_meta": pl_module.built_on_meta,
            "local_rank_env": os.environ.get("LOCAL_RANK"),
            "after_configure_model": self.after_configure_model,
            "at_start": self.at_start,
            "trained": hashlib.sha256(json.dumps(trained, sort_keys=True).encode()).hexdigest(),
            "has_reference": pl_module.ref_policy is not None,
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0 = full fine-tuning)")
    parser.add_argument("--kl-coef", type=float, default=0.1)
    parser.add_argument("--load-once-per-node", type=int, choices=[0, 1], default=1)
    parser.add_argument("--max-steps", type=int, default=1)
    parser.add_argument(
        "--smollm2", choices=["float32", "bfloat16"], default=None, help="SmolLM2 in this dtype"
    )
    args = parser.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    seed_everything(0)
    settings = dict(process_group_backend="gloo", placement="hybrid", max_staleness=0, max_inflight=1)
    strategy = (AsyncRolloutDDPStrategy if args.parallel == "ddp" else AsyncRolloutFSDPStrategy)(**settings)
    record = Record()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.max_steps,
        callbacks=[WeightSyncCallback(), WeightVersionLogger(histogram_every_n_steps=0), record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = module_for(args.lora, args.kl_coef, bool(args.load_once_per_node), args.smollm2)
    configure_model = module.configure_model

    def recording_configure_model():  # what the module itself did, before DDP's own sync at wrapping
        configure_model()
        record.after_configure_model = tensor_digests(module)

    module.configure_model = recording_configure_model
    data = PromptDataModule(train="digit_successor", batch_size=2, num_train_prompts=64, shuffle=False)
    trainer.fit(module, datamodule=data)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record.final))


if __name__ == "__main__":
    main()
