"""The embedded default engine: ``transformers`` ``generate`` on CPU or GPU.

Behaviour log-prob of a sampled token: ``log_softmax(raw_logits / T)[token]``, from the model's raw
float32 logits at that generation step (before every logits processor: no top-p / top-k / min-p
truncation, no repetition penalty, no generation-config processors such as ``suppress_tokens``),
at the request's temperature ``T``; a greedy request (temperature 0) reports them at ``T = 1``. So
they are the log-probs of the distribution the trainer recomputes (temperature-scaled, before
truncation), while the sample itself is drawn from the processed distribution. Every option of
:class:`~unirl_lightning.rollout.records.SamplingParams` reaches ``generate`` (:func:`generate_kwargs`).

A request whose longest prompt plus ``max_new_tokens`` exceeds the model's
``max_position_embeddings`` is refused with a ``ValueError`` naming the numbers (``generate``
would run past the positions the model was built with).

They are scored as ``generate`` goes (:class:`StepScorer`, a forward hook on the model): each step's
log-softmax row is kept until the next step's input reveals the token sampled from it, so one
``[B, V]`` row is held at a time, where keeping ``output_logits`` held ``[B, T, V]`` (and a float32
copy of it) to the end.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from unirl_lightning.core.seeding import derive_seed
from unirl_lightning.engines.base import (
    InPlaceBucketLoading,
    TorchThreadsEngineConfig,
    check_context,
    engine_device,
    make_group,
    trim_at_stop,
)
from unirl_lightning.models.causal_lm import PolicySpec
from unirl_lightning.models.lora import (
    LLM_LORA_TARGETS,
    LoraSpec,
    apply_lora,
    effective_weights,
    load_named_weights,
    share_named_weights,
    unwrapped,
)
from unirl_lightning.rollout.records import FinishReason, Rollout, RolloutRequest, SamplingParams

log = logging.getLogger(__name__)


def generate_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """The sampling part of ``model.generate``'s keyword arguments for ``sampling`` (greedy for
    temperature 0, where truncation is moot; the repetition penalty applies to both)."""
    kwargs: dict[str, Any] = dict(max_new_tokens=sampling.max_new_tokens, do_sample=sampling.temperature != 0)
    if sampling.temperature != 0:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        if sampling.min_p > 0:
            kwargs["min_p"] = sampling.min_p
    if sampling.repetition_penalty != 1:
        kwargs["repetition_penalty"] = sampling.repetition_penalty
    return kwargs


@dataclass
class HFEngineConfig(TorchThreadsEngineConfig):
    """Configuration of the ``transformers`` engine (the default for token policies).

    Args:
        device: ``"auto"`` = cuda if visible, else cpu.
        num_threads: torch intra-op threads in the worker: ``"auto"`` = the strategy's CPU rule (every
            core while a synchronous run generates; ``ceil(num_cpus_per_worker)`` when async), an
            int, or None = leave torch's default.
        max_batch_size: sequences per ``generate`` call; with ``batching="continuous"``, the engine's
            slots (rows decoding at once), plus a stage of at most twice as many prefilled prompts.
        share_prompt_prefill: rows of a call with the same prompt (a group's ``n`` samples) share
            one prefill: the prompt, all but its last token, runs once per distinct prompt and its KV
            cache is copied to each of its rows before ``generate`` decodes (what vLLM's prefix
            caching does for a group). The samples and log-probs are those of the plain path up to
            float rounding (the prefill runs at another batch size). Off, or a call without repeated
            prompts or with a one-token prompt, prefills every row. With ``batching="continuous"``,
            rows staged together with the same prompt share its prefill (the whole prompt).

    Example::

        AsyncRolloutStrategy(engine=HFEngineConfig(device="cpu", num_threads=1))
    """

    device: str = "auto"
    num_threads: int | Literal["auto"] | None = "auto"
    max_batch_size: int = 256
    share_prompt_prefill: bool = True
    batching: Literal["static", "continuous"] = "static"
    concurrent_calls: int = 8

    def __post_init__(self) -> None:
        if self.batching not in ("static", "continuous"):
            raise ValueError(
                f"HFEngineConfig batching={self.batching!r} is invalid; expected 'static' or 'continuous'"
            )
        if self.concurrent_calls < 1:
            raise ValueError(f"HFEngineConfig concurrent_calls={self.concurrent_calls} must be at least 1")

    @property
    def loads_in_flight(self) -> bool:
        """A weight load may land while rows are generating (between two decode steps, each token
        keeping its version): ``sync_mode="continue"`` needs it."""
        return self.batching == "continuous"

    @property
    def max_concurrency(self) -> int:
        """Calls one Ray worker runs at once (its actor's ``max_concurrency``)."""
        return self.concurrent_calls if self.batching == "continuous" else 1

    def build(self, policy: PolicySpec, lora: LoraSpec | None = None) -> HFEngine:
        if self.batching == "continuous":  # an HFEngine subclass, found by module name as ENGINES are
            module = importlib.import_module("unirl_lightning.engines.hf_continuous")
            return module.ContinuousHFEngine(self, policy, lora)
        return HFEngine(self, policy, lora)


class HFEngine(InPlaceBucketLoading):  # a streamed push is loaded bucket by bucket, in place
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
        self.shares_trainer_weights = False  # the trainer's tensors themselves (placement="hybrid")
        # None for a model without absolute positions in its config (nothing to check then); also the
        # agentic coordinator's context budget (it ends an episode that would outgrow it, cleanly)
        self.max_positions = getattr(unwrapped(self.model).config, "max_position_embeddings", None)
        if isinstance(self.max_positions, int):
            self.max_model_len = self.max_positions
        self._started = time.perf_counter()
        self._row_seconds = 0.0  # active rows x seconds of every generate call (occupancy)
        self._call_seconds = 0.0  # seconds inside generate calls

    def occupancy(self) -> dict[str, float]:
        """``{"row_seconds", "seconds", "slots", "starved_slot_seconds"}``: active rows x seconds over
        every ``generate`` call (a finished row waiting for the call's longest is not active), the
        engine's age, its slots (``max_batch_size``), and every slot x the seconds it ran no call (it
        waited on its callers; the free slots of a running call are its own tail, not starved);
        :class:`~unirl_lightning.rollout.occupancy.OccupancyMeter` reads them."""
        seconds = time.perf_counter() - self._started
        slots = float(self.config.max_batch_size)
        return {
            "row_seconds": self._row_seconds,
            "seconds": seconds,
            "slots": slots,
            "starved_slot_seconds": slots * max(0.0, seconds - self._call_seconds),
        }

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> None:
        load_named_weights(self.model, named_tensors, self.lora)
        self.weight_version = weight_version

    def share_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> int:
        """An engine in the training process (``placement="hybrid"``) reads the trainer's tensors: each
        one of the model's dtype, device and shape is taken as is (no copy), the others are copied in
        place, cast (:func:`~unirl_lightning.models.lora.share_named_weights`); LoRA adapters are copied.
        Returns the bytes copied; the engine serves ``weight_version`` from now on."""
        named = list(named_tensors)
        if self.lora is not None:
            load_named_weights(self.model, named, self.lora)
            copied = sum(t.numel() * t.element_size() for _, t in named)
        else:
            copied, shared = share_named_weights(self.model, named)
            self.shares_trainer_weights = shared > 0
        self.weight_version = weight_version
        return copied

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights the engine generates with (LoRA adapters merged in), by the base model's names."""
        return effective_weights(self.model)

    def sleep(self) -> None:
        if self.device.type != "cuda" or self.shares_trainer_weights:
            log.info("HF engine on %s: sleep is a no-op (nothing of its own to free)", self.device)
            return
        self.model.to("cpu")
        torch.cuda.empty_cache()

    def wake(self, tags: list[str] | None = None) -> None:
        """Move the model back (``tags`` are ignored: the model is the weights, there is no KV cache
        to restore; a second call is a no-op)."""
        self.model.to(self.device)

    def close(self) -> None:
        """Nothing to free beyond the model, which goes with the worker."""

    # -- generation ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, request: RolloutRequest) -> list[list[Rollout]]:
        prompts = [self.policy.prompt_ids(self.tokenizer, record) for record in request.records]
        groups: list[list[Rollout]] = []
        per_call = max(1, self.config.max_batch_size // request.n)
        for chunk, start in enumerate(range(0, len(prompts), per_call)):
            seed = None if request.seed is None else derive_seed(request.seed, chunk)
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
        with ``derive_seed(seed, k)``: no two calls share a seed). The agentic coordinator calls it once per turn with the
        whole context of every live episode, so earlier turns are never re-tokenized.
        """
        size = self.config.max_batch_size
        samples = []
        for start in range(0, len(prompt_ids), size):
            chunk_seed = None if seed is None else derive_seed(seed, start // size)
            samples.extend(self._generate_rows(prompt_ids[start : start + size], sampling, chunk_seed))
        return samples

    def _generate_rows(self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None):
        tok = self.tokenizer
        width = max(len(ids) for ids in prompts)  # left-pad to one width
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(ids)) + ids for ids in prompts])
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        greedy = sampling.temperature == 0
        check_context(width, sampling.max_new_tokens, self.max_positions, "max_position_embeddings")
        if seed is not None:
            torch.manual_seed(seed)
        gen_kwargs = generate_kwargs(sampling)
        gen_kwargs.update(pad_token_id=tok.pad_token_id, eos_token_id=self.stop_ids)
        if sampling.stop:
            gen_kwargs.update(stop_strings=list(sampling.stop), tokenizer=tok)
        if self.config.share_prompt_prefill:
            shared = self._shared_prefill(prompts, input_ids, attention_mask)
            if shared is not None:
                gen_kwargs.update(shared)
        scorer = StepScorer(temperature=1.0 if greedy else sampling.temperature)
        started = time.perf_counter()
        with scorer.attached(unwrapped(self.model)):
            sequences = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **gen_kwargs)
        seconds = time.perf_counter() - started
        new_tokens = sequences[:, width:]
        logps = scorer.logprobs(new_tokens)
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
        longest = max((len(c) for c, _, _ in samples), default=0)
        self._call_seconds += seconds
        if longest:  # every decode step costs about the same: a row is active for len/longest of the call
            self._row_seconds += seconds * sum(len(c) for c, _, _ in samples) / longest
        return samples

    def _shared_prefill(
        self, prompts: list[list[int]], input_ids: torch.Tensor, attention_mask: torch.Tensor
    ):
        """The KV cache of every row's prompt but its last token, computed once per distinct prompt and
        copied to its rows (``generate`` then runs only the last prompt token and the decode steps);
        None when no prompt repeats or a prompt has one token (nothing to share: prefill every row).
        Returned as ``generate``'s keyword (``cache`` from transformers 5, ``past_key_values`` before)."""
        index_of: dict[tuple[int, ...], int] = {}  # a distinct prompt -> its place among the distinct
        distinct: list[int] = []  # the first row of each distinct prompt
        rows_of: list[int] = []  # each row's distinct prompt
        for row, prompt in enumerate(prompts):
            key = tuple(prompt)
            if key not in index_of:
                index_of[key] = len(distinct)
                distinct.append(row)
            rows_of.append(index_of[key])
        if len(distinct) == len(prompts) or min(len(ids) for ids in prompts) < 2:
            return None
        ids, mask = input_ids[distinct, :-1], attention_mask[distinct, :-1]
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate derives them
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        name = "cache" if "cache" in out.keys() else "past_key_values"
        cache = out[name]
        if not hasattr(cache, "batch_select_indices"):  # a cache kind rows cannot be copied in
            return None
        cache.batch_select_indices(torch.tensor(rows_of, device=input_ids.device))
        return {name: cache}


class StepScorer:
    """The behaviour log-prob of every token ``generate`` samples, scored as it goes.

    A forward hook on the causal LM (the model ``generate`` calls once per step): each call's
    last-position logits become ``log_softmax(logits.float() / temperature)`` (the values
    ``output_logits`` would have kept: the raw logits, upcast as ``generate`` upcasts them), and
    the next call's input ids (whose last column is the token just sampled) pick that token's
    log-prob from it. :meth:`logprobs` scores the final step's token from the returned sequences
    and checks that every token it scored is the one ``generate`` returned (a decoding loop that
    broke "each forward sees the previous sample last" would raise, not mis-score).
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self._row: torch.Tensor | None = None  # [B, V] log-softmax of the step whose sample is unseen
        self._tokens: list[torch.Tensor] = []
        self._logprobs: list[torch.Tensor] = []

    @contextlib.contextmanager
    def attached(self, model: torch.nn.Module) -> Iterator[StepScorer]:
        handle = model.register_forward_hook(self._hook, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()

    def _score(self, tokens: torch.Tensor) -> None:
        assert self._row is not None
        self._logprobs.append(self._row.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
        self._tokens.append(tokens)
        self._row = None

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if self._row is not None:  # every call after the prefill: its last input is the last sample
            self._score(input_ids[:, -1])
        logits = output.logits[:, -1].float()  # a copy: the step's logits are not kept alive
        self._row = torch.log_softmax(logits / self.temperature, dim=-1)

    def logprobs(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """``[B, n]`` log-probs of the ``n`` generated tokens ``new_tokens`` (float32)."""
        n = new_tokens.shape[1]
        if len(self._logprobs) < n and self._row is not None:
            self._score(new_tokens[:, len(self._logprobs)])
        if len(self._logprobs) < n:
            raise RuntimeError(
                f"scored {len(self._logprobs)} generation steps of {n}: generate skipped a forward"
            )
        scored = torch.stack(self._tokens[:n], dim=1)
        if not torch.equal(scored, new_tokens):
            raise RuntimeError(
                "the tokens scored during generate are not the ones it returned: this transformers version's "
                "decoding loop does not feed each step the previous sample (behaviour log-probs would be wrong)"
            )
        return torch.stack(self._logprobs[:n], dim=1)
