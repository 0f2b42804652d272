"""Continuous batching for a ``transformers`` causal LM: rows join the running batch as soon as a slot
frees and leave it the step they finish, so the engine keeps ``max_rows`` rows decoding while work is
queued, instead of a ``generate`` call lasting as long as its longest row.

One :meth:`ContinuousBatcher.step` decodes one token for every active row (``input_ids [B, 1]``,
explicit ``position_ids``, the 2-D attention mask that marks each row's padding), then refills the
slots of the rows that finished. Refilling is staged: waiting rows are prefilled ``max_rows`` at a
time (one forward, their first token sampled then) into a stage, and a staged row takes a finished
row's slot in place, its prompt KV written right-aligned into that slot's cache row and the columns
before it masked as padding: no forward and no copy of the running cache per refill, so a slot is
refilled the step its row finishes. Rows staged together with the same prompt (a group's samples)
share its prefill (``share_prompts``). A staged prompt wider than the running cache waits for a
compaction (``Cache.batch_select_indices``) and is appended, its KV padded to the running width. The
cache columns that are padding for every row are trimmed (views). The stage holds the prompt KV of at
most ``2 * max_rows`` rows beyond the slots. ``stage=False`` keeps the earlier refill (one prefill
forward per refill, once ``compact_at`` rows finished), for comparison.

Sampling per row (:class:`~unirl_lightning.engines.row_sampler.RowSampler`), as the static HF engine
does: a seeded row's tokens do not depend on which other rows share its batch or when it joined (or
whether it was staged). Every token records the weight version it was sampled under (``versions``),
so a row continued across a weight update (:meth:`ContinuousBatcher.step` runs under the engine's
lock; a push between two steps continues every row in place, staged rows included) reports the
version of each token.

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
from unirl_lightning.engines.row_sampler import RowSampler
from unirl_lightning.rollout.records import FinishReason, SamplingParams

__all__ = ["BatchRow", "ContinuousBatcher"]

STAGED_REFILL_AT = 1  # finished rows that trigger a refill from the stage (no forward: a copy of prompts)


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
        stage: refill from a stage of prefilled rows, in place (the default; see the module docstring).
        share_prompts: rows staged together with the same prompt (a group's samples) share one prefill:
            the prompt runs once and its rows keep views of the same KV (copied when each takes a slot).
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
        stage: bool = True,
        share_prompts: bool = True,
    ) -> None:
        self.model, self.device, self.version = model, device, version
        self.pad_id, self.max_rows, self.max_positions = pad_id, max_rows, max_positions
        self._cache_kw = _cache_kwarg(model)
        self.waiting: deque[BatchRow] = deque()
        self.active: list[BatchRow] = []
        self.stage, self.share_prompts = stage, share_prompts
        # prefilled rows (first token sampled) waiting for a slot, each with its prompt KV per layer
        self.staged: list[tuple[BatchRow, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [B, L] 1 = a real token of the row
        # finished rows that trigger a compaction (and, without the stage, a refill): an eighth of the
        # slots, and at least sqrt(slots), since an unstaged refill is a prefill forward of its own (16
        # slots: 4, not 2; measured in docs/engines.md: 5% more tokens/s at 16 slots, the same at 128)
        self.compact_at = max(1, max_rows // 8, round(max_rows**0.5))
        self.refill_at = STAGED_REFILL_AT if stage else self.compact_at
        self.row_seconds = 0.0
        self.counted_at = time.perf_counter()  # the end of the last step counted in row_seconds
        self.busy_seconds = 0.0  # seconds of the steps that produced a token
        self.steps = 0  # steps that produced a token (decode steps, and stage prefills with no decode)
        # slots x seconds free with no row queued (waiting or staged): what was admitted ran out, so the
        # engine waited on its callers (the staleness window, max_inflight, the trainer), not on itself
        self.starved_slot_seconds = 0.0
        # nothing pending after the last step: the loop waits for rows until the next one
        self._out_of_work = True
        self.sampler = RowSampler(device, stop_ids, tokenizer)

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
        for i in reversed([i for i, (row, _) in enumerate(self.staged) if predicate(row)]):
            hit.append(self.staged.pop(i)[0])
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
        """Rows waiting, staged or decoding."""
        return len(self.waiting) + len(self.staged) + len(self.active)

    # -- one step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> int:
        """Decode one token for every live row (a finished row is reported at once, its slot freed at
        the next compaction), then, once enough slots are free, fill them; returns the number of rows
        that produced a token (0: nothing to do).

        Filling: with ``stage`` (the default), waiting rows are prefilled ``max_rows`` at a time into a
        stage (one forward; their first token is sampled then) and move from the stage into free slots
        without a forward of their own (their prompt KV is copied in), so a slot is refilled
        ``refill_at`` (1) finished rows at a time. Without it, waiting rows join in one prefill per
        refill, once ``compact_at`` rows have finished (a forward per refill costs about a decode step
        on a small model, so refilling after every finished row would spend one per row). Slots are
        compacted (``Cache.batch_select_indices``, a copy of the whole cache) only when a refill is
        due, every row finished, or ``compact_at`` rows did."""
        start = time.perf_counter()
        if self._out_of_work:  # the loop waited for rows since the last step: every slot was free
            self.starved_slot_seconds += self.max_rows * (start - self.counted_at)
        produced = in_slots = self.live
        if produced:
            self._decode()
        dead = len(self.active) - self.live
        if self.stage and dead and (self.staged or self.waiting):
            produced += self._stage_for(dead)
            replaced = self._replace()
            in_slots += replaced
            dead -= replaced
        queued = len(self.staged) + len(self.waiting)
        if dead and (
            dead == len(self.active) or dead >= self.compact_at or (queued and dead >= self.refill_at)
        ):
            self._select([i for i, row in enumerate(self.active) if row.finish_reason is None])
        free = self.max_rows - len(self.active)
        if queued and free and (free >= self.refill_at or free >= queued or not self.active):
            if not self.stage:
                joining = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
                self._join(joining)
                produced += len(joining)
                in_slots += len(joining)
            else:
                produced += self._stage_for(free)
                admitted = min(free, len(self.staged))
                if admitted:
                    self._admit(admitted)
                    in_slots += admitted
        end = time.perf_counter()
        seconds = end - start
        self.row_seconds += min(in_slots, self.max_rows) * seconds
        if not (self.staged or self.waiting):  # free slots and nothing to fill them with
            self.starved_slot_seconds += (self.max_rows - min(in_slots, self.max_rows)) * seconds
        self._out_of_work = not self.pending
        if produced:
            self.busy_seconds += seconds
            self.steps += 1
        self.counted_at = end  # last: a report read from another thread is never ahead of the counters
        return produced

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

    def _prefill(self, rows: list[BatchRow]) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """One forward of ``rows``' prompts, left-padded among themselves: (last logits, cache, mask)."""
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
        return logits, cache, mask

    def _join(self, rows: list[BatchRow]) -> None:
        logits, cache, mask = self._prefill(rows)
        self._merge(cache, mask)
        self.active.extend(rows)
        self._sample(rows, logits)

    def _stage_for(self, slots: int) -> int:
        """Fewer rows staged than ``slots``: prefill the next ``max_rows`` waiting rows into the stage and
        sample their first token (a row that ends there never takes a slot); returns how many produced
        a token. Each staged row keeps views of its own prompt KV (no copy until it is admitted)."""
        if len(self.staged) >= slots or not self.waiting:
            return 0
        rows = [self.waiting.popleft() for _ in range(min(self.max_rows, len(self.waiting)))]
        firsts, prompt_of = self._distinct(rows)
        logits, cache, mask = self._prefill(firsts)
        self._sample(rows, logits[torch.tensor(prompt_of, device=logits.device)])
        width = mask.shape[1]
        layers = self._layers(cache)
        for j, row in zip(prompt_of, rows):
            if row.finish_reason is None:
                pad = width - len(row.prompt_ids)
                kv = [(layer.keys[j : j + 1, :, pad:], layer.values[j : j + 1, :, pad:]) for layer in layers]
                self.staged.append((row, kv))
        return len(rows)

    def _distinct(self, rows: list[BatchRow]) -> tuple[list[BatchRow], list[int]]:
        """The rows to prefill (the first row of each distinct prompt with ``share_prompts``, else every
        row) and, for each of ``rows``, the index of its prompt among them."""
        if not self.share_prompts:
            return rows, list(range(len(rows)))
        firsts: list[BatchRow] = []
        index: dict[tuple[int, ...], int] = {}
        prompt_of = []
        for row in rows:
            key = tuple(row.prompt_ids)
            if key not in index:
                index[key] = len(firsts)
                firsts.append(row)
            prompt_of.append(index[key])
        return firsts, prompt_of

    def _replace(self) -> int:
        """Put staged rows into the slots of finished ones, in place: a staged row whose prompt fits the
        running cache's width is written right-aligned into a finished row's slot (its KV over the
        slot's last columns, the columns before it masked as padding); no copy of the cache, no
        forward. Returns how many slots were refilled."""
        assert self._mask is not None
        width = self._mask.shape[1]
        layers = self._layers(self._cache)
        refilled = 0
        for i, old in enumerate(self.active):
            if old.finish_reason is None:
                continue
            j = next((k for k, (row, _) in enumerate(self.staged) if len(row.prompt_ids) <= width), None)
            if j is None:
                break
            row, kv = self.staged.pop(j)
            start = width - len(row.prompt_ids)
            for layer, (keys, values) in zip(layers, kv):
                layer.keys[i, :, start:] = keys[0]
                layer.values[i, :, start:] = values[0]
            self._mask[i] = 0
            self._mask[i, start:] = 1
            self.active[i] = row
            refilled += 1
        if refilled:
            self._trim()
        return refilled

    def _admit(self, count: int) -> None:
        """Move the first ``count`` staged rows into free slots: their prompt KV, left-padded to the
        widest, is appended to the running cache (a copy of their prompts only, no forward)."""
        from transformers import DynamicCache

        rows, kvs = zip(*self.staged[:count])
        del self.staged[:count]
        width = max(len(row.prompt_ids) for row in rows)
        pads = [width - len(row.prompt_ids) for row in rows]

        def stacked(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:  # every row's, left-padded
            return torch.cat([torch.nn.functional.pad(t, (0, 0, pad, 0)) for t, pad in zip(tensors, pads)])

        data = []
        for layer in zip(*kvs):  # one layer: each row's (keys, values)
            keys, values = zip(*layer)
            data.append((stacked(keys), stacked(values)))
        mask = torch.tensor(
            [[0] * pad + [1] * len(row.prompt_ids) for row, pad in zip(rows, pads)], device=self.device
        )
        self._merge(DynamicCache(ddp_cache_data=data), mask)
        self.active.extend(rows)

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
        """Draw one token per live row from its last logits and record it; report the rows it ended."""
        for row in self.sampler.sample(rows, logits, self.version()):
            self._finish(row, row.finish_reason)

    def _select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` of the batch (cache, mask and list), then drop the cache columns that
        are padding for every row left."""
        self.active = [self.active[i] for i in keep]
        if not keep:
            self._cache = self._mask = None
            return
        assert self._mask is not None
        self._cache.batch_select_indices(torch.tensor(keep, device=self.device))
        self._mask = self._mask[keep]
        self._trim()

    def _trim(self) -> None:
        """Drop the leading cache columns that are padding for every row (views: no copy)."""
        assert self._mask is not None
        first = int(self._mask.any(dim=0).nonzero()[0])
        if first:
            for layer in self._layers(self._cache):
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
            self._mask = self._mask[:, first:]

    @staticmethod
    def _finish(row: BatchRow, reason: FinishReason) -> None:
        row.finish_reason = reason
        if row.on_finish is not None:
            row.on_finish(row)
