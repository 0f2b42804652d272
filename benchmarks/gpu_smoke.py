"""GPU smoke check of precision and memory: one process, one CUDA device, one JSON report.

Checks, each recorded under ``checks`` with ``ok``, its figures and its seconds (a failing check
records its error and the next one still runs):

* ``mixed_precision``: a GRPO module on a bf16 policy keeps float32 masters (and a fused AdamW
  with float32 state), a bf16 frozen reference, computes bf16 logits under autocast on CUDA, and one step at
  lr 1e-6 moves the masters with a gradient (few of them move once rounded to bf16: what pure bf16
  weights lost).
* ``logprob_memory``: peak ``torch.cuda.max_memory_allocated`` of a log-prob forward + backward
  from bf16 logits at vocabulary 151936, chunked (``token_logprobs``) vs the former row loop.
* ``hf_generate``: the HF engine on CUDA generating with behaviour log-probs (peak memory and time,
  scored step by step vs the former kept ``output_logits``; the two must give the same log-probs).
* ``weight_push``: CUDA float32 masters packed as the object-store push packs them (cast to bf16
  tensor by tensor) and loaded into that engine: bit-equal to the masters rounded to bf16; the
  collective layout is all bf16.
* ``on_policy_pin``: the engine's bf16 behaviour log-probs vs the trainer's (bf16 autocast over the
  pushed float32 masters) on the engine's own samples: max / mean abs gap (and the gap of a plain
  bf16 full forward of the engine's model, which isolates what KV-cache decoding alone gives).
* ``fsdp2_fit``: one Lightning ``Trainer.fit`` step with ``ModelParallelStrategy`` (FSDP2, 1 rank,
  NCCL) of the same module on pre-collated batches: float32 ``DTensor`` masters, bf16
  ``MixedPrecisionPolicy``, the step runs and moves the weights.

No Ray cluster, CLI, math-verify, diffusers or vLLM is used (importing the modules imports the
``ray`` and ``jsonargparse`` packages; the report lists which of those got imported and whether Ray
was started). The whole run takes a minute or two on one H200 (a deadline skips what is left after
7 minutes). Without CUDA it prints one line saying so and exits 0; ``--cpu`` runs the same checks on
CPU at small sizes (FSDP2 over gloo), to check the script itself.

    python benchmarks/gpu_smoke.py [--out benchmarks/results/gpu_smoke.json]
    make gpu-smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_smoke.json"
DEADLINE_S = 7 * 60
MB = 2**20


class Smoke:
    """Runs named checks, records each (figures, ok, seconds, error), skips them past the deadline."""

    def __init__(self, device: Any, sizes: dict[str, int]) -> None:
        self.device = device
        self.sizes = sizes
        self.start = time.perf_counter()
        self.checks: dict[str, dict[str, Any]] = {}

    def run(self, name: str, fn, *args: Any) -> Any:
        if time.perf_counter() - self.start > DEADLINE_S:
            self.checks[name] = {"ok": False, "skipped": f"past the {DEADLINE_S} s deadline"}
            return None
        began = time.perf_counter()
        record: dict[str, Any] = {}
        try:
            value = fn(record, *args)
            record.setdefault("ok", True)
        except Exception as exc:  # noqa: BLE001 - a smoke check reports every failure and goes on
            value = None
            record.update(
                ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:]
            )
        record["seconds"] = round(time.perf_counter() - began, 3)
        self.checks[name] = record
        print(f"{name}: {'ok' if record['ok'] else 'FAILED'} ({record['seconds']} s)", flush=True)
        return value


# -- memory ------------------------------------------------------------------------------------------
def reset_peak(device: Any) -> float:
    import torch

    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / MB


def peak_above(device: Any, base: float) -> float | None:
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return round(torch.cuda.max_memory_allocated(device) / MB - base, 1)


# -- the pieces --------------------------------------------------------------------------------------
def spec(sizes: dict[str, int]):
    from unirl_lightning.models import TinyCausalLM

    return TinyCausalLM(
        hidden_size=sizes["hidden"],
        num_layers=sizes["layers"],
        num_heads=4,
        intermediate_size=2 * sizes["hidden"],
        max_position_embeddings=512,
        vocab_size=sizes["vocab"],
        dtype="bfloat16",
    )


def smoke_module(sizes: dict[str, int], **overrides: Any):
    """A GRPO module on the bf16 policy, without the callbacks that need the rollout strategy."""
    from unirl_lightning.modules import GRPOModule
    from unirl_lightning.rewards import ExactMatchReward

    class SmokeGRPO(GRPOModule):
        def configure_callbacks(self):  # the defaults drive the rollout strategy's weight sync
            return []

    kwargs = dict(
        policy=spec(sizes),
        reward=ExactMatchReward(),
        num_generations=4,
        max_new_tokens=sizes["new_tokens"],
        temperature=1.0,
        lr=1e-6,
    )
    kwargs.update(overrides)
    return SmokeGRPO(**kwargs)


def random_batch(sizes: dict[str, int], pad_token_id: int, seed: int = 0):
    import torch

    from unirl_lightning.rollout.batches import ExperienceBatch
    from unirl_lightning.rollout.records import Rollout

    g = torch.Generator().manual_seed(seed)
    rows = [
        Rollout(
            prompt_ids=torch.randint(3, 20, (int(p),), generator=g).tolist(),
            completion_ids=torch.randint(3, sizes["vocab"], (sizes["new_tokens"],), generator=g).tolist(),
            logprobs=[-1.0] * sizes["new_tokens"],
            reward=float(i % 2),
            finish_reason="length",
        )
        for i, p in enumerate(torch.randint(4, 12, (8,), generator=g))
    ]
    groups = [rows[i : i + 4] for i in range(0, len(rows), 4)]
    return ExperienceBatch.collate(groups, pad_token_id=pad_token_id)


def check_mixed_precision(record: dict, smoke: Smoke):
    import torch

    module = smoke_module(smoke.sizes, kl_coef=0.05)
    module.setup("fit")
    module.to(smoke.device)
    optimizer = module.configure_optimizers()
    batch = random_batch(smoke.sizes, module.tokenizer.pad_token_id).to(smoke.device)
    with module.autocast(smoke.device.type):
        logits_dtype = module.policy(input_ids=batch.input_ids[:, :4]).logits.dtype
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    optimizer.zero_grad()
    logp = module.sequence_logprobs(module.policy, batch)
    (-(logp * batch.response_mask[:, 1:]).sum()).backward()
    # the elements with a gradient (embedding rows of tokens absent from the batch have none)
    touched = torch.cat([(p.grad != 0).flatten() for p in module.policy.parameters()])
    optimizer.step()
    masters = torch.cat([(p.detach() != before[n]).flatten() for n, p in module.policy.named_parameters()])
    rounded = torch.cat(
        [
            (p.detach().bfloat16() != before[n].bfloat16()).flatten()
            for n, p in module.policy.named_parameters()
        ]
    )
    states = [s for s in optimizer.state.values() if s]
    record.update(
        param_dtypes=sorted({str(p.dtype) for p in module.policy.parameters()}),
        reference_dtypes=sorted({str(p.dtype) for p in module.ref_policy.parameters()}),
        optimizer_state_dtypes=sorted({str(s["exp_avg"].dtype) for s in states}),
        optimizer_fused=bool(optimizer.param_groups[0]["fused"]),  # torch's fused AdamW kernel on the device
        autocast_logits_dtype=str(logits_dtype),
        logprob_dtype=str(logp.dtype),
        fraction_masters_moved=float(masters[touched].float().mean()),
        fraction_bf16_rounded_moved=float(rounded[touched].float().mean()),
    )
    record["ok"] = (
        record["param_dtypes"] == ["torch.float32"]
        and record["reference_dtypes"] == ["torch.bfloat16"]
        and record["optimizer_state_dtypes"] == ["torch.float32"]
        and record["optimizer_fused"]
        and logits_dtype == torch.bfloat16
        and record["fraction_masters_moved"] > 0.9
    )
    return module


def old_token_logprobs(logits, tokens, temperature):
    """The former bf16 row loop (every row's float32 copy kept for the backward)."""
    import torch

    rows = []
    for row_logits, row_index in zip(logits, tokens.long().unsqueeze(-1)):
        scaled = row_logits.float() / temperature
        rows.append(scaled.gather(-1, row_index).squeeze(-1) - torch.logsumexp(scaled, dim=-1))
    return torch.stack(rows)


def check_logprob_memory(record: dict, smoke: Smoke) -> None:
    import torch

    from unirl_lightning.algorithms import token_logprobs

    device, vocab = smoke.device, smoke.sizes["memory_vocab"]
    batch, length, hidden = smoke.sizes["memory_batch"], smoke.sizes["memory_length"], 256
    g = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(vocab, hidden, device=device, generator=g) * 0.02).bfloat16().requires_grad_(True)
    states = torch.randn(batch, length, hidden, device=device, generator=g).bfloat16()
    tokens = torch.randint(0, vocab, (batch, length), device=device, generator=g)
    record.update(
        vocab=vocab, batch=batch, length=length, float32_bvt_mb=round(batch * length * vocab * 4 / MB, 1)
    )
    results = {}
    for name, compute in (("before_row_loop", old_token_logprobs), ("after_chunked", token_logprobs)):
        weight.grad = None
        base = reset_peak(device)
        began = time.perf_counter()
        logits = states @ weight.T  # bf16 [B, T, V]
        logp = compute(logits, tokens, 0.7)
        del logits
        logp.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        results[name] = {
            "peak_above_start_mb": peak_above(device, base),
            "seconds": round(time.perf_counter() - began, 3),
            "logp_sum": float(logp.detach().double().sum()),
            "grad_norm": float(weight.grad.float().norm()),
        }
        del logp
    record.update(results)
    before, after = results["before_row_loop"], results["after_chunked"]
    record["same_values"] = (
        abs(before["logp_sum"] - after["logp_sum"]) <= 1e-4 * abs(before["logp_sum"]) + 1e-3
    )
    record["same_gradients"] = (
        abs(before["grad_norm"] - after["grad_norm"]) <= 1e-2 * before["grad_norm"] + 1e-6
    )
    record["ok"] = record["same_values"] and record["same_gradients"]
    if device.type == "cuda":
        record["ok"] = record["ok"] and after["peak_above_start_mb"] < before["peak_above_start_mb"]


def kept_logits_generate(engine, prompts, sampling, seed):
    """The former engine scoring: keep ``output_logits`` of every step, stack, upcast, log-softmax."""
    import torch

    tok = engine.tokenizer
    width = max(len(ids) for ids in prompts)
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(ids)) + ids for ids in prompts]).to(
        engine.device
    )
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts]).to(
        engine.device
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        out = engine.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=sampling.max_new_tokens,
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=0,
            pad_token_id=tok.pad_token_id,
            eos_token_id=engine.stop_ids,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new_tokens = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float() / sampling.temperature
        logps = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
    return new_tokens.cpu(), logps.cpu()


def check_hf_generate(record: dict, smoke: Smoke):
    import torch

    from unirl_lightning.engines.hf import HFEngine, HFEngineConfig
    from unirl_lightning.rollout.records import SamplingParams
    from unirl_lightning.seeding import derive_seed

    sizes = smoke.sizes
    engine = HFEngine(HFEngineConfig(device=smoke.device.type, num_threads=None), spec(sizes), None)
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, 20, (int(n),), generator=g).tolist() for n in torch.randint(4, 12, (sizes["rows"],))
    ]
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=sizes["new_tokens"])
    record.update(rows=len(prompts), new_tokens=sampling.max_new_tokens, vocab=sizes["vocab"])
    base = reset_peak(smoke.device)
    began = time.perf_counter()
    # the engine seeds its first call of at most max_batch_size rows with derive_seed(seed, 0)
    kept_tokens, kept_logps = kept_logits_generate(engine, prompts, sampling, seed=derive_seed(5, 0))
    record["before_kept_logits"] = {
        "peak_above_start_mb": peak_above(smoke.device, base),
        "seconds": round(time.perf_counter() - began, 3),
    }
    base = reset_peak(smoke.device)
    began = time.perf_counter()
    samples = engine.generate_ids(prompts, sampling, seed=5)
    record["after_streamed"] = {
        "peak_above_start_mb": peak_above(smoke.device, base),
        "seconds": round(time.perf_counter() - began, 3),
    }
    gaps, same_tokens = [], True
    for row, (completion, logprobs, _) in enumerate(samples):
        same_tokens &= completion == kept_tokens[row, : len(completion)].tolist()
        gaps.append((torch.tensor(logprobs) - kept_logps[row, : len(completion)]).abs().max().item())
    record.update(
        same_tokens=bool(same_tokens),
        max_abs_logprob_diff_vs_kept=max(gaps),
        tokens_generated=sum(len(c) for c, _, _ in samples),
    )
    # the same seed on CUDA can sample differently when kernels differ; the log-probs must agree where tokens do
    record["ok"] = bool(same_tokens) and max(gaps) < 1e-4
    return engine, prompts, sampling


def check_weight_push(record: dict, smoke: Smoke, module, engine) -> None:
    import torch

    from unirl_lightning.weight_sync.base import named_weights, serving_dtype, tensor_bytes
    from unirl_lightning.weight_sync.buckets import (
        PackedWeights,
        pack_tensors,
        unpack_tensors,
        weight_buckets,
    )
    from unirl_lightning.weight_sync.collective import _bucket_layout

    dtype = serving_dtype(module.policy)
    tensors = named_weights(module.policy, dtype)  # CUDA float32 masters, as held
    record.update(
        serving_dtype=str(dtype),
        held_devices=sorted({str(t.device) for t in tensors.values()}),
        held_dtypes=sorted({str(t.dtype) for t in tensors.values()}),
        pushed_mb=round(tensor_bytes(tensors, dtype) / MB, 1),
        held_mb=round(tensor_bytes(tensors) / MB, 1),
    )
    packed = PackedWeights.pack(tensors.items(), dtype)
    engine.load_weights(packed.tensors(), weight_version=1)
    served = engine.state_dict()
    rounded = {n: t.detach().to(torch.bfloat16).cpu() for n, t in tensors.items()}
    record["packed_dtypes"] = sorted(set(packed.dtypes))
    record["engine_bit_equal_to_rounded_masters"] = all(served[n].equal(rounded[n]) for n in rounded)
    # the serving engines' path: whole-layer buckets of cast tensors, packed for an RPC, unpacked
    cast = [(n, t.to(torch.bfloat16)) for n, t in tensors.items()]
    buckets = list(weight_buckets(cast, bucket_bytes=64 * MB, whole_layers=True))
    restored = dict(p for b in buckets for p in unpack_tensors(pack_tensors(b, as_bytes=True)))
    record["rpc_roundtrip_bit_equal"] = all(restored[n].equal(rounded[n]) for n in rounded)
    layout, dtypes = _bucket_layout(tensors, bucket_bytes=64 * MB, dtype=dtype)
    record["collective_bucket_dtypes"] = sorted({str(d) for d in dtypes})
    record["ok"] = (
        record["packed_dtypes"] == ["bfloat16"]
        and record["engine_bit_equal_to_rounded_masters"]
        and record["rpc_roundtrip_bit_equal"]
        and record["collective_bucket_dtypes"] == ["torch.bfloat16"]
    )


def check_on_policy_pin(record: dict, smoke: Smoke, module, engine, prompts, sampling) -> None:
    import torch

    from unirl_lightning.rollout.batches import ExperienceBatch
    from unirl_lightning.rollout.records import Rollout

    samples = engine.generate_ids(prompts, sampling, seed=7)
    rows = [
        Rollout(prompt_ids=p, completion_ids=c, logprobs=lp, reward=0.0, finish_reason=f)
        for p, (c, lp, f) in zip(prompts, samples)
    ]
    batch = ExperienceBatch.collate([rows], pad_token_id=module.tokenizer.pad_token_id).to(smoke.device)
    mask = batch.response_mask[:, 1:].bool()
    behaviour = batch.rollout_logprobs[:, 1:]
    with torch.no_grad():
        trainer_logp = module.sequence_logprobs(module.policy, batch)
        engine_model_logp = module.sequence_logprobs(engine.model, batch)  # bf16 weights, full forward
    gap = (trainer_logp - behaviour).abs()[mask]
    decode_gap = (engine_model_logp - behaviour).abs()[mask]
    record.update(
        tokens=int(mask.sum()),
        trainer_vs_engine_max_abs=float(gap.max()),
        trainer_vs_engine_mean_abs=float(gap.mean()),
        ratio_mean=float(torch.exp(trainer_logp - behaviour)[mask].mean()),
        bf16_full_forward_vs_engine_max_abs=float(decode_gap.max()),
        bf16_full_forward_vs_engine_mean_abs=float(decode_gap.mean()),
    )
    # bf16 compute: a per-token gap of a few 1e-2 is bf16's resolution; the mean ratio must stay ~1
    record["ok"] = record["trainer_vs_engine_mean_abs"] < 0.05 and abs(record["ratio_mean"] - 1) < 0.05


def check_fsdp2_fit(record: dict, smoke: Smoke) -> None:
    import torch
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader

    from unirl_lightning.sharding import is_sharded

    module = smoke_module(smoke.sizes, kl_coef=0.05)
    batches = [random_batch(smoke.sizes, module.tokenizer.pad_token_id, seed=s) for s in range(2)]
    backend = "nccl" if smoke.device.type == "cuda" else "gloo"
    trainer = Trainer(
        accelerator=smoke.device.type,
        devices=1,
        strategy=ModelParallelStrategy(process_group_backend=backend),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    params = list(module.policy.parameters())
    optimizer = trainer.optimizers[0]
    states = [s for s in optimizer.state.values() if s]
    param_dtype = None
    if hasattr(module.policy, "_get_fsdp_state"):  # an FSDP2 module: its root group's policy
        group = module.policy._get_fsdp_state()._fsdp_param_group
        param_dtype = str(group.mp_policy.param_dtype) if group is not None else None
    record.update(
        backend=backend,
        global_step=trainer.global_step,
        sharded=all(is_sharded(p) for p in params),
        master_dtypes=sorted({str(p.dtype) for p in params}),
        reference_dtypes=sorted({str(p.dtype) for p in module.ref_policy.parameters()}),
        optimizer_state_dtypes=sorted({str(s["exp_avg"].dtype) for s in states}),
        mixed_precision_param_dtype=param_dtype,
        loss=float(module.last_step_metrics.get("loss", float("nan"))),
    )
    record["ok"] = (
        trainer.global_step == 2
        and record["sharded"]
        and record["master_dtypes"] == ["torch.float32"]
        and record["optimizer_state_dtypes"] == ["torch.float32"]
        and param_dtype == "torch.bfloat16"
        and record["loss"] == record["loss"]
    )
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# -- main --------------------------------------------------------------------------------------------
GPU_SIZES = dict(
    vocab=151936,
    hidden=256,
    layers=2,
    new_tokens=64,
    rows=64,
    memory_vocab=151936,
    memory_batch=8,
    memory_length=1024,
)
CPU_SIZES = dict(
    vocab=2048, hidden=32, layers=1, new_tokens=8, rows=6, memory_vocab=4096, memory_batch=2, memory_length=32
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where the JSON report goes")
    parser.add_argument("--cpu", action="store_true", help="run the checks on CPU at small sizes (a dry run)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.cpu:
        print("gpu_smoke: no CUDA device (torch.cuda.is_available() is False): nothing checked, exiting 0")
        return 0
    sys.path.insert(0, str(ROOT))
    import warnings

    warnings.filterwarnings("ignore")
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    smoke = Smoke(device, CPU_SIZES if args.cpu else GPU_SIZES)
    module = smoke.run("mixed_precision", check_mixed_precision, smoke)
    smoke.run("logprob_memory", check_logprob_memory, smoke)
    generated = smoke.run("hf_generate", check_hf_generate, smoke)
    if module is not None and generated is not None:
        engine, prompts, sampling = generated
        smoke.run("weight_push", check_weight_push, smoke, module, engine)
        smoke.run("on_policy_pin", check_on_policy_pin, smoke, module, engine, prompts, sampling)
        del engine
    del module, generated
    if device.type == "cuda":
        torch.cuda.empty_cache()
    smoke.run("fsdp2_fit", check_fsdp2_fit, smoke)

    ray = sys.modules.get("ray")
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "sizes": smoke.sizes,
        "ok": all(c.get("ok") for c in smoke.checks.values()),
        "seconds": round(time.perf_counter() - smoke.start, 1),
        "imported": sorted(
            m for m in ("ray", "jsonargparse", "math_verify", "diffusers", "vllm") if m in sys.modules
        ),
        "ray_initialized": bool(ray is not None and ray.is_initialized()),
        "checks": smoke.checks,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "checks"}))
    print(f"wrote {out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
