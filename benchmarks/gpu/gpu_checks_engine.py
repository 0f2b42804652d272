"""The GPU smoke checks of the engine side (``gpu_smoke.py``): ``hf_generate`` (the HF engine's streamed
behaviour log-probs vs the former kept ``output_logits``), ``weight_push`` (masters packed and loaded
as the pushes do, bit-equal to the masters rounded to bf16) and ``on_policy_pin`` (the engine's bf16
log-probs vs the trainer's). A helper module (no ``main``)."""

from __future__ import annotations

import time
from typing import Any

from benchmarks.gpu.gpu_checks_memory import MB, peak_above, reset_peak
from benchmarks.gpu.gpu_checks_train import spec


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


def check_hf_generate(record: dict, smoke: Any):
    import torch

    from unirl_lightning.core.seeding import derive_seed
    from unirl_lightning.engines.hf import HFEngine, HFEngineConfig
    from unirl_lightning.rollout.records import SamplingParams

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


def check_weight_push(record: dict, smoke: Any, module, engine) -> None:
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


def check_on_policy_pin(record: dict, smoke: Any, module, engine, prompts, sampling) -> None:
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
