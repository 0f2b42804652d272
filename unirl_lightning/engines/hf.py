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
from typing import Any, Literal

import torch

from unirl_lightning.engines.base import EngineConfig, engine_device, make_group, trim_at_stop
from unirl_lightning.lora import LLM_LORA_TARGETS, LoraSpec, apply_lora, effective_weights, load_named_weights
from unirl_lightning.models import PolicySpec
from unirl_lightning.rollout.types import FinishReason, Rollout, RolloutRequest, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class HFEngineConfig(EngineConfig):
    """Configuration of the ``transformers`` engine (the default for token policies).

    Args:
        device: ``"auto"`` = cuda if visible, else cpu.
        num_threads: torch intra-op threads in the worker: ``"auto"`` = the strategy's CPU rule (every
            core while a synchronous run generates; ``ceil(num_cpus_per_worker)`` when async), an
            int, or None = leave torch's default.
        max_batch_size: sequences per ``generate`` call.

    Example::

        AsyncRolloutStrategy(engine=HFEngineConfig(device="cpu", num_threads=1))
    """

    device: str = "auto"
    num_threads: int | Literal["auto"] | None = "auto"
    max_batch_size: int = 256

    def build(self, policy: PolicySpec, lora: LoraSpec | None = None) -> HFEngine:
        return HFEngine(self, policy, lora)


class HFEngine:
    """Generates groups with ``model.generate``; see the module docstring for the log-prob contract."""

    def __init__(self, config: HFEngineConfig, policy: PolicySpec, lora: LoraSpec | None) -> None:
        self.config = config
        self.lora = lora
        self.device = engine_device(config.device, config.num_threads)
        self.model, self.tokenizer = policy.build()
        if lora is not None:
            self.model = apply_lora(self.model, lora, LLM_LORA_TARGETS)
        self.model.to(self.device).eval().requires_grad_(False)
        self.policy = policy
        self.stop_ids = policy.stop_ids(self.tokenizer)  # EOS (and the chat template's end of turn)
        self.weight_version = 0

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> None:
        load_named_weights(self.model, named_tensors, self.lora)
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

    def close(self) -> None:
        """Nothing to free beyond the model, which goes with the worker."""

    # -- generation ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, request: RolloutRequest) -> list[list[Rollout]]:
        prompts = [self.policy.prompt_ids(self.tokenizer, record) for record in request.records]
        groups: list[list[Rollout]] = []
        per_call = max(1, self.config.max_batch_size // request.n)
        for start in range(0, len(prompts), per_call):
            seed = None if request.seed is None else request.seed + start
            samples = self._sample(prompts[start : start + per_call], request, seed)
            for offset, group_samples in enumerate(samples):
                index = start + offset
                groups.append(
                    make_group(
                        request, index, prompts[index], group_samples, self.tokenizer, self.weight_version
                    )
                )
        return groups

    def _sample(self, prompts: list[list[int]], request: RolloutRequest, seed: int | None):
        """``request.n`` samples of each prompt: ``[(completion_ids, logprobs, finish_reason), ...]`` per prompt."""
        rows = [ids for ids in prompts for _ in range(request.n)]
        flat = self.generate_ids(rows, request.sampling, seed)
        return [flat[i * request.n : (i + 1) * request.n] for i in range(len(prompts))]

    @torch.no_grad()
    def generate_ids(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int | None = None
    ) -> list[tuple[list[int], list[float], FinishReason]]:
        """The token-level entry point: one sample per row of ``prompt_ids`` (token ids, any lengths).

        Returns ``(completion_ids, logprobs, finish_reason)`` per row, log-probs as in the module
        docstring. Rows are sampled in calls of at most ``max_batch_size`` (the ``k``-th call seeded
        with ``seed + k * max_batch_size``). The agentic coordinator calls it once per turn with the
        whole context of every live episode, so earlier turns are never re-tokenized.
        """
        size = self.config.max_batch_size
        samples = []
        for start in range(0, len(prompt_ids), size):
            chunk_seed = None if seed is None else seed + start
            samples.extend(self._generate_rows(prompt_ids[start : start + size], sampling, chunk_seed))
        return samples

    def _generate_rows(self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None):
        tok = self.tokenizer
        width = max(len(ids) for ids in prompts)  # left-pad to one width
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(ids)) + ids for ids in prompts])
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        greedy = sampling.temperature == 0
        if seed is not None:
            torch.manual_seed(seed)
        gen_kwargs: dict[str, Any] = dict(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy,
            pad_token_id=tok.pad_token_id,
            eos_token_id=self.stop_ids,
            output_logits=True,
            return_dict_in_generate=True,
        )
        if not greedy:
            gen_kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        if sampling.stop:
            gen_kwargs.update(stop_strings=list(sampling.stop), tokenizer=tok)
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **gen_kwargs)
        new_tokens = out.sequences[:, width:]
        temperature = 1.0 if greedy else sampling.temperature
        logits = torch.stack(out.logits, dim=1).float() / temperature  # [B, T, V]
        logps = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        new_tokens, logps = new_tokens.tolist(), logps.cpu()
        samples = []
        for row in range(len(prompts)):
            # rows stop at a stop token, a stop string or the limit; the padding after a stop goes
            completion, finish = trim_at_stop(new_tokens[row], self.stop_ids)
            if finish == "length" and sampling.stop and completion[-1] == tok.pad_token_id:
                while completion and completion[-1] == tok.pad_token_id:  # ended by a stop string
                    completion.pop()
                finish = "stop"
            samples.append((completion, logps[row, : len(completion)].tolist(), finish))
        return samples
