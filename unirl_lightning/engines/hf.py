"""The embedded default engine: ``transformers`` ``generate`` on CPU or GPU.

Behaviour log-probs are taken from the raw logits of every generation step (``output_logits``),
divided by the sampling temperature, so they are the log-probs of the distribution the trainer
recomputes (temperature-scaled, before top-p truncation). Greedy (temperature 0) requests report
log-probs at temperature 1.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from unirl_lightning.engines.base import engine_device
from unirl_lightning.lora import LLM_LORA_TARGETS, LoraSpec, apply_lora, effective_weights, load_named_weights
from unirl_lightning.models import PolicySpec
from unirl_lightning.rollout.types import Rollout, RolloutRequest

log = logging.getLogger(__name__)


@dataclass
class HFEngineConfig:
    """Configuration of the ``transformers`` engine (the default).

    Example::

        HFEngineConfig(device="cpu", num_threads=1)  # policy: the module's
    """

    policy: PolicySpec | None = None  # None = the module's policy
    lora: LoraSpec | None = None  # filled in by the module when it trains LoRA adapters
    device: str = "auto"  # "auto" = cuda if visible, else cpu
    num_threads: int | None = 1  # torch intra-op threads in the worker (None = leave torch's default)
    max_batch_size: int = 256  # sequences per generate call

    def build(self) -> HFEngine:
        if self.policy is None:
            raise ValueError(
                "HFEngineConfig.policy is None: give a policy spec, or let the module fill it in"
            )
        return HFEngine(self)


class HFEngine:
    """Generates groups with ``model.generate``; see the module docstring for the log-prob contract."""

    def __init__(self, config: HFEngineConfig) -> None:
        self.config = config
        self.device = engine_device(config.device, config.num_threads)
        self.model, self.tokenizer = config.policy.build()
        if config.lora is not None:
            self.model = apply_lora(self.model, config.lora, LLM_LORA_TARGETS)
        self.model.to(self.device).eval().requires_grad_(False)
        self.weight_version = 0

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> None:
        load_named_weights(self.model, named_tensors, self.config.lora)
        self.weight_version = weight_version

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights the engine generates with (LoRA adapters merged in), by the base model's names."""
        return effective_weights(self.model)

    def sleep(self) -> None:
        if self.device.type != "cuda":
            log.info("HF engine on %s: sleep is a no-op (nothing to free)", self.device)
            return
        self.model.to("cpu")
        torch.cuda.empty_cache()

    def wake(self) -> None:
        self.model.to(self.device)

    # -- generation ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, request: RolloutRequest) -> list[list[Rollout]]:
        groups: list[list[Rollout]] = []
        per_call = max(1, self.config.max_batch_size // request.n)
        for start in range(0, len(request.records), per_call):
            chunk = request.records[start : start + per_call]
            seed = None if request.seed is None else request.seed + start
            groups.extend(self._generate_chunk(chunk, request, seed, group_offset=start))
        return groups

    def _generate_chunk(
        self, records: list[dict[str, Any]], request: RolloutRequest, seed, group_offset: int
    ):
        sampling = request.sampling
        tok = self.tokenizer
        prompts = [r["prompt"] for r in records]
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        input_ids = enc["input_ids"].repeat_interleave(request.n, dim=0).to(self.device)
        attention_mask = enc["attention_mask"].repeat_interleave(request.n, dim=0).to(self.device)
        greedy = sampling.temperature == 0
        if seed is not None:
            torch.manual_seed(seed)
        gen_kwargs: dict[str, Any] = dict(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        if not greedy:
            gen_kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        if sampling.stop:
            gen_kwargs.update(stop_strings=list(sampling.stop), tokenizer=tok)
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **gen_kwargs)
        prompt_len = input_ids.shape[1]
        new_tokens = out.sequences[:, prompt_len:]
        temperature = 1.0 if greedy else sampling.temperature
        logits = torch.stack(out.logits, dim=1).float() / temperature  # [B, T, V]
        logps = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        new_tokens, logps = new_tokens.cpu(), logps.cpu()
        groups: list[list[Rollout]] = []
        for i, record in enumerate(records):
            prompt_ids = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
            group = []
            for j in range(request.n):
                row = i * request.n + j
                completion, finish = self._trim(new_tokens[row].tolist(), sampling.max_new_tokens)
                group.append(
                    Rollout(
                        prompt_ids=prompt_ids,
                        completion_ids=completion,
                        logprobs=logps[row, : len(completion)].tolist(),
                        reward=0.0,
                        finish_reason=finish,
                        text=tok.decode(completion, skip_special_tokens=True),
                        prompt=record["prompt"],
                        group_id=group_offset + i,
                        gen_id=request.gen_id,
                        weight_version=self.weight_version,
                    )
                )
            groups.append(group)
        return groups

    def _trim(self, tokens: list[int], max_new_tokens: int) -> tuple[list[int], str]:
        """Cut at the first eos (kept, so the policy learns to stop); the padding after it goes."""
        eos = self.tokenizer.eos_token_id
        if eos in tokens:
            return tokens[: tokens.index(eos) + 1], "stop"
        # no eos: generate ran this row to max_new_tokens (rows stop only at eos or the limit)
        return tokens, "length"
