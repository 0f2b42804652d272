"""The GPU smoke check of vocabulary-sized memory (``gpu_smoke.py``): ``logprob_memory``, the peak CUDA
memory of a log-prob forward + backward from bf16 logits, chunked (``token_logprobs``) vs the former
row loop; and the peak-memory helpers the other checks use. A helper module (no ``main``)."""

from __future__ import annotations

import time
from typing import Any

MB = 2**20


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


def old_token_logprobs(logits, tokens, temperature):
    """The former bf16 row loop (every row's float32 copy kept for the backward)."""
    import torch

    rows = []
    for row_logits, row_index in zip(logits, tokens.long().unsqueeze(-1)):
        scaled = row_logits.float() / temperature
        rows.append(scaled.gather(-1, row_index).squeeze(-1) - torch.logsumexp(scaled, dim=-1))
    return torch.stack(rows)


def check_logprob_memory(record: dict, smoke: Any) -> None:
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
