"""Continuous batching for a ``transformers`` causal LM: rows join the running batch as soon as a slot
frees and leave it the step they finish, so the engine keeps ``max_rows`` rows decoding while work is
queued, instead of a ``generate`` call lasting as long as its longest row.

One :meth:`ContinuousBatcher.step` admits waiting rows into free slots (one prefill of the new rows,
left-padded among themselves, whose KV cache is padded to the running cache's width and joined to it),
then decodes one token for every active row (``input_ids [B, 1]``, explicit ``position_ids``, the
2-D attention mask that marks each row's padding), then retires the finished rows
(``Cache.batch_select_indices``) and trims the cache columns that are padding for every row left.

Sampling per row, as the static HF engine does (see :mod:`~unirl_lightning.engines.hf`): the behaviour
log-prob is ``log_softmax(raw_logits / T)[token]`` from the raw float32 logits (``T = 1`` for a greedy
row); the token is drawn from the processed distribution (``transformers``' own temperature, top-k,
top-p, min-p and repetition-penalty processors). A seeded row owns a ``torch.Generator`` and draws by
the exponential race (``argmax(p / q)``, ``q ~ Exp(1)`` from the row's generator, as vLLM's sampler
does for seeded requests): a seeded row's tokens do not depend on which other rows share its batch or
when it joined. Every token records the weight version it was sampled under (``versions``), so a
row continued across a weight update (:meth:`ContinuousBatcher.step` runs under the engine's lock;
a push between two steps continues every row in place) reports the version of each token.

Not thread-safe by itself: the streaming engine calls it from one thread under one lock.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from unirl_lightning.engines.base import check_context
from unirl_lightning.rollout.records import FinishReason, SamplingParams

__all__ = ["BatchRow", "ContinuousBatcher"]


@dataclass(eq=False)
class BatchRow:
    """One sequence to complete: its prompt ids, sampling, optional seed, and what it produced so far.
    ``on_finish(row)`` is called once, from the batcher's thread, when it stops (``finish_reason``
    ``"stop"``, ``"length"`` or ``"aborted"``)."""

    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int | None = None
    on_finish: Callable[[BatchRow], None] | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None


def _cache_kwarg(model: Any) -> str:
    """The name the model's forward takes its KV cache by (``cache`` from transformers 5.x, else
    ``past_key_values``)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _processors(sampling: SamplingParams) -> list[Any]:
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


class ContinuousBatcher:
    """Token-level continuous batching of :class:`BatchRow` s over ``model`` (a causal LM whose cache is
    a ``DynamicCache`` of full-attention layers).

    Args:
        model: the causal LM (in eval mode, on ``device``).
        device: where its inputs go.
        stop_ids: token ids that end a row (EOS and the chat template's end of turn).
        pad_id: the id left-padding uses in a prefill.
        max_rows: slots: the most rows decoding at once.
        max_positions: the model's ``max_position_embeddings`` (None: unchecked).
        tokenizer: decodes a row's tail for its stop strings (only rows whose sampling has ``stop``).
        version: ``version()`` -> the weight version the model holds now (stamped on every token).
    """

    def __init__(
        self,
        model: Any,
        device: torch.device,
        *,
        stop_ids: list[int],
        pad_id: int,
        max_rows: int,
        max_positions: int | None = None,
        tokenizer: Any = None,
        version: Callable[[], int] = lambda: 0,
    ) -> None:
        self.model, self.device, self.stop_ids = model, device, set(stop_ids)
        self.pad_id, self.max_rows, self.max_positions = pad_id, max_rows, max_positions
        self.tokenizer, self.version = tokenizer, version
        self._cache_kw = _cache_kwarg(model)
        self.waiting: deque[BatchRow] = deque()
        self.active: list[BatchRow] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [B, L] 1 = a real token of the row
        # finished rows that trigger a compaction and a refill: an eighth of the slots, and at least
        # sqrt(slots), since every refill is a prefill forward of its own (16 slots: 4, not 2; measured
        # in docs/engines.md: 5% more tokens/s at 16 slots, the same at 128)
        self.compact_at = max(1, max_rows // 8, round(max_rows**0.5))
        self.row_seconds = 0.0
        self.counted_at = time.perf_counter()  # the end of the last step counted in row_seconds
        self.busy_seconds = 0.0
        self._processors: dict[SamplingParams, list[Any]] = {}  # transformers' processors, per sampling

    # -- rows in and out ---------------------------------------------------------------------------
    def add(self, row: BatchRow) -> None:
        """Queue ``row``; it joins the batch at the first step with a free slot."""
        check_context(
            len(row.prompt_ids), row.sampling.max_new_tokens, self.max_positions, "max_position_embeddings"
        )
        if row.seed is not None:
            row.generator = torch.Generator(device=self.device).manual_seed(row.seed)
        self.waiting.append(row)

    def abort(self, predicate: Callable[[BatchRow], bool]) -> int:
        """End every waiting or active row for which ``predicate(row)`` is true with ``"aborted"``
        (its tokens so far kept); returns how many."""
        hit = [row for row in self.waiting if predicate(row)]
        for row in hit:
            self.waiting.remove(row)
        live_hit = [row for row in self.active if row.finish_reason is None and predicate(row)]
        if live_hit:
            hit += live_hit
            self._select(
                [i for i, row in enumerate(self.active) if row.finish_reason is None and row not in live_hit]
            )
        for row in hit:
            self._finish(row, "aborted")
        return len(hit)

    @property
    def pending(self) -> int:
        """Rows waiting or decoding."""
        return len(self.waiting) + len(self.active)

    # -- one step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> int:
        """Decode one token for every live row (a finished row is reported at once, its slot freed at
        the next compaction), then, once enough slots are free, admit waiting rows (their prefill samples
        their first token); returns the number of rows that produced a token (0: nothing to do).

        Slots are compacted (``Cache.batch_select_indices``, a copy of the whole cache) only when every
        row finished or ``compact_at`` rows did: refilling one slot per step would copy the cache every
        step, so finished rows ride along for a few steps and joiners come in batches."""
        start = time.perf_counter()
        rows = self.live
        if rows:
            self._decode()
        dead = len(self.active) - self.live
        if dead and (dead == len(self.active) or dead >= self.compact_at):
            self._select([i for i, row in enumerate(self.active) if row.finish_reason is None])
        free = self.max_rows - len(self.active)
        if self.waiting and (free >= self.compact_at or free >= len(self.waiting) or not self.active):
            joining = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
            self._join(joining)
            rows += len(joining)
        self.counted_at = time.perf_counter()
        seconds = self.counted_at - start
        self.row_seconds += min(rows, self.max_rows) * seconds
        self.busy_seconds += seconds if rows else 0.0
        return rows

    @property
    def live(self) -> int:
        """Rows in the batch still decoding (the rest are finished, waiting for a compaction)."""
        return sum(row.finish_reason is None for row in self.active)

    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any):
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_kw: cache},
        )
        name = "cache" if "cache" in out.keys() else "past_key_values"
        return out.logits[:, -1].float(), out[name]

    def _join(self, rows: list[BatchRow]) -> None:
        from transformers import DynamicCache

        width = max(len(row.prompt_ids) for row in rows)
        ids = torch.tensor(
            [[self.pad_id] * (width - len(r.prompt_ids)) + r.prompt_ids for r in rows], device=self.device
        )
        mask = torch.tensor(
            [[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in rows], device=self.device
        )
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits, cache = self._forward(ids, mask, positions, DynamicCache())
        self._merge(cache, mask)
        self.active.extend(rows)
        self._sample(rows, logits)

    def _merge(self, cache: Any, mask: torch.Tensor) -> None:
        """Join a prefill's cache (rows ``mask``) to the running one, left-padding the narrower."""
        if self._cache is None or not self.active:
            self._cache, self._mask = cache, mask
            return
        assert self._mask is not None
        old, new = self._mask.shape[1], mask.shape[1]
        width = max(old, new)
        for mine, theirs in zip(self._layers(self._cache), self._layers(cache)):
            for name in ("keys", "values"):
                a, b = getattr(mine, name), getattr(theirs, name)
                a = torch.nn.functional.pad(a, (0, 0, width - old, 0))
                b = torch.nn.functional.pad(b, (0, 0, width - new, 0))
                setattr(mine, name, torch.cat([a, b], dim=0))
        self._mask = torch.cat(
            [
                torch.nn.functional.pad(self._mask, (width - old, 0)),
                torch.nn.functional.pad(mask, (width - new, 0)),
            ]
        )

    @staticmethod
    def _layers(cache: Any) -> list[Any]:
        layers = getattr(cache, "layers", None)
        if layers is None or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
            raise RuntimeError(
                "continuous batching needs a model whose KV cache is transformers' DynamicCache of full-attention "
                f"layers (got {type(cache).__name__}); use HFEngineConfig(batching='static') for this model"
            )
        return layers

    def _decode(self) -> None:
        assert self._mask is not None
        last = torch.tensor([[row.tokens[-1]] for row in self.active], device=self.device)
        positions = torch.tensor(
            [[len(row.prompt_ids) + len(row.tokens) - 1] for row in self.active], device=self.device
        )
        mask = torch.cat(
            [self._mask, torch.ones(len(self.active), 1, dtype=self._mask.dtype, device=self.device)], dim=1
        )
        logits, self._cache = self._forward(last, mask, positions, self._cache)
        self._mask = mask
        self._sample(self.active, logits)

    def _sample(self, rows: list[BatchRow], logits: torch.Tensor) -> None:
        """Draw one token per row from its last logits (``logits[-len(rows):]``) and record it."""
        logits = logits[-len(rows) :]
        version = self.version()
        by_sampling: dict[SamplingParams, list[int]] = {}
        for i, row in enumerate(rows):
            if row.finish_reason is None:  # a finished row riding along until the next compaction
                by_sampling.setdefault(row.sampling, []).append(i)
        finished: list[BatchRow] = []
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
                processors = self._processors[sampling] = _processors(sampling)
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
        for row in finished:
            self._finish(row, row.finish_reason)

    def _hit_stop_string(self, row: BatchRow, stops: tuple[str, ...]) -> bool:
        text = self.tokenizer.decode(row.tokens[-16:], skip_special_tokens=True)
        return any(stop in text for stop in stops)

    def _select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` of the batch (cache, mask and list), then drop the cache columns that
        are padding for every row left."""
        self.active = [self.active[i] for i in keep]
        if not keep:
            self._cache = self._mask = None
            return
        assert self._mask is not None
        self._cache.batch_select_indices(torch.tensor(keep, device=self.device))
        mask = self._mask[keep]
        first = int(mask.any(dim=0).nonzero()[0])  # leading columns no row uses any more
        if first:
            for layer in self._layers(self._cache):
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
            mask = mask[:, first:]
        self._mask = mask

    @staticmethod
    def _finish(row: BatchRow, reason: FinishReason) -> None:
        row.finish_reason = reason
        if row.on_finish is not None:
            row.on_finish(row)
