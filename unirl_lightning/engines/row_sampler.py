"""Per-row sampling for the continuous batcher (:mod:`~unirl_lightning.engines.batcher`), as the static
HF engine samples (see :mod:`~unirl_lightning.engines.hf`).

The behaviour log-prob is ``log_softmax(raw_logits / T)[token]`` from the raw float32 logits (``T = 1``
for a greedy row); the token is drawn from the processed distribution (``transformers``' own
temperature, top-k, top-p, min-p and repetition-penalty processors). A seeded row owns a
``torch.Generator`` and draws by the exponential race (``argmax(p / q)``, ``q ~ Exp(1)`` from the row's
generator, as vLLM's sampler does for seeded requests), so its tokens do not depend on which rows share
its batch or when it joined. A row is any object with the batcher's row fields (``prompt_ids``,
``sampling``, ``generator``, ``tokens``, ``logprobs``, ``versions``, ``finish_reason``).
"""

from __future__ import annotations

from typing import Any

import torch

from unirl_lightning.rollout.records import SamplingParams

__all__ = ["RowSampler", "processors_for"]


def processors_for(sampling: SamplingParams) -> list[Any]:
    """``transformers``' own logits processors for ``sampling`` (temperature first, as ``generate``
    orders them; none for a greedy row but the repetition penalty)."""
    from transformers.generation import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    out: list[Any] = []
    if sampling.repetition_penalty != 1:
        out.append(RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty))
    if sampling.temperature == 0:
        return out
    if sampling.temperature != 1:
        out.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k and sampling.top_k > 0:
        out.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1:
        out.append(TopPLogitsWarper(sampling.top_p))
    if sampling.min_p > 0:
        out.append(MinPLogitsWarper(sampling.min_p))
    return out


class RowSampler:
    """Samples one token per live row; ``stop_ids`` end a row, ``tokenizer`` decodes a row's tail for its
    stop strings (only rows whose sampling has ``stop``)."""

    def __init__(self, device: torch.device, stop_ids: Any, tokenizer: Any = None) -> None:
        self.device, self.stop_ids, self.tokenizer = device, set(stop_ids), tokenizer
        self._processors: dict[SamplingParams, list[Any]] = {}  # transformers' processors, per sampling

    def sample(self, rows: list[Any], logits: torch.Tensor, version: int) -> list[Any]:
        """Draw one token per live row of ``rows`` from its last logits (``logits[-len(rows):]``),
        record it (token, log-prob, ``version``) and return the rows it ended (``finish_reason`` set)."""
        logits = logits[-len(rows) :]
        by_sampling: dict[SamplingParams, list[int]] = {}
        for i, row in enumerate(rows):
            if row.finish_reason is None:  # a finished row riding along until the next compaction
                by_sampling.setdefault(row.sampling, []).append(i)
        finished: list[Any] = []
        for sampling, idx in by_sampling.items():
            raw = logits[idx]
            greedy = sampling.temperature == 0
            logp = torch.log_softmax(raw / (1.0 if greedy else sampling.temperature), dim=-1)
            scores = raw
            history = None
            if sampling.repetition_penalty != 1:
                seqs = [rows[i].prompt_ids + rows[i].tokens for i in idx]
                width = max(len(s) for s in seqs)
                history = torch.tensor([s + [s[0]] * (width - len(s)) for s in seqs], device=self.device)
            processors = self._processors.get(sampling)
            if processors is None:
                processors = self._processors[sampling] = processors_for(sampling)
            for processor in processors:
                scores = processor(history, scores)
            if greedy:
                tokens = scores.argmax(dim=-1)
            else:
                probs = torch.softmax(scores, dim=-1)
                q = torch.empty_like(probs)
                for j, i in enumerate(idx):
                    q[j].exponential_(generator=rows[i].generator)  # None: the global generator
                tokens = (probs / q).argmax(dim=-1)
            chosen = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
            for j, (i, token) in enumerate(zip(idx, tokens.tolist())):
                row = rows[i]
                row.tokens.append(token)
                row.logprobs.append(chosen[j])
                row.versions.append(version)
                if token in self.stop_ids:
                    row.finish_reason = "stop"
                elif sampling.stop and self._hit_stop_string(row, sampling.stop):
                    row.finish_reason = "stop"
                elif len(row.tokens) >= sampling.max_new_tokens:
                    row.finish_reason = "length"
                if row.finish_reason is not None:
                    finished.append(row)
        return finished

    def _hit_stop_string(self, row: Any, stops: tuple[str, ...]) -> bool:
        text = self.tokenizer.decode(row.tokens[-16:], skip_special_tokens=True)
        return any(stop in text for stop in stops)
