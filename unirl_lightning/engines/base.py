"""The engine contract: what a rollout worker needs from an inference engine, and the glue every
engine shares.

Who builds an engine: the strategy ships an :class:`EngineConfig` to each rollout worker, which
calls ``config.build(policy, lora)`` with the module's policy spec and LoRA spec (the module says
*what* is served, the engine config *how*). Called inside a worker process (a Ray actor), one call
at a time. Guarantees:

* ``generate(request)`` returns one group per prompt record, ``request.n`` rollouts each, with the
  behaviour log-prob of every sampled token computed at ``request.sampling.temperature`` (the
  temperature the trainer recomputes at). Rewards are left at 0: the worker scores them.
* ``load_weights(named_tensors, weight_version)`` replaces the weights it generates with; the
  tensors are full parameters by name (or, for LoRA engines, adapter parameters only). They may be
  views of shared memory that other workers read too: the engine copies from them, never writes
  to them and keeps none after the call.
* Optionally (:class:`BucketedWeightLoader`: HF, vLLM, diffusion) a full push arrives in buckets:
  ``begin_weight_load()``, ``load_weight_bucket(named_tensors)`` per bucket (the same rules as
  ``load_weights``: copy, never write, keep nothing), ``finish_weight_load(weight_version)``. The
  engine serves the new version from ``finish_weight_load`` on; pushes happen while no request is in
  flight, so weights loaded in place bucket by bucket are never seen half loaded. For an engine
  without it the worker keeps a copy of each bucket and calls ``load_weights`` once at the end.
* ``sleep()`` / ``wake(tags=None)`` release and restore accelerator memory for colocated placement;
  engines that cannot do it treat both as no-ops. ``tags`` wakes part of the engine: ``["weights"]``
  (before a weight push), ``["kv_cache"]`` (after it); None wakes everything still asleep. Engines
  that cannot wake in parts wake everything on the first call and ignore the second. ``close()`` frees what the engine holds (processes,
  temporary files); the worker calls it before it exits.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

import torch

from unirl_lightning.core.seeding import derive_seed
from unirl_lightning.rollout.records import FinishReason, PolicyFamily, Rollout, RolloutRequest


@runtime_checkable
class RolloutEngine(Protocol):
    weight_version: int

    def generate(self, request: RolloutRequest) -> list[list[Any]]: ...

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int
    ) -> None: ...

    def sleep(self) -> None: ...

    def wake(self, tags: list[str] | None = None) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class BucketedWeightLoader(Protocol):
    """An engine that loads a full push bucket by bucket as the buckets arrive (see the module's
    contract). ``finish_weight_load(None)`` ends an interrupted push: the engine closes what it
    opened and keeps its weight version."""

    def begin_weight_load(self) -> None: ...

    def load_weight_bucket(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def finish_weight_load(self, weight_version: int | None) -> None: ...


class InPlaceBucketLoading:
    """:class:`BucketedWeightLoader` for an engine whose ``load_weights`` copies each tensor into its
    parameters in place: a bucket is loaded as it arrives (the version unchanged), and the new version
    is taken at ``finish_weight_load``. Mixed into the HF and diffusion engines."""

    weight_version: int  # and the engine's load_weights(named_tensors, weight_version)

    def begin_weight_load(self) -> None:
        """Nothing to open: the buckets are copied in place."""

    def load_weight_bucket(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.load_weights(named_tensors, self.weight_version)

    def finish_weight_load(self, weight_version: int | None) -> None:
        if weight_version is not None:
            self.weight_version = weight_version


@runtime_checkable
class WeightGroupMember(Protocol):
    """An engine that joins the collective weight-sync group itself (vLLM: the member is the code in
    vLLM's own worker process, so the broadcast lands where the model lives, with no host copy in
    between). A rollout worker whose engine is one delegates the collective backend's endpoints to
    it; other engines (HF, diffusion) get the worker's own
    :class:`~unirl_lightning.weight_sync.collective.CollectiveReceiver` and ``load_weights``."""

    def join_weight_group(
        self, backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float
    ) -> None: ...

    def receive_weights(self, layout: Any, dtypes: Any, weight_version: int) -> None: ...

    def leave_weight_group(self) -> None: ...


class EngineConfig:
    """Base of every engine configuration (a dataclass subclass per engine).

    ``family`` says which policies it serves: ``"token"`` (causal LMs: GRPO, PPO) or
    ``"diffusion"`` (flow-matching image models: Flow-GRPO). ``build`` runs inside the worker.
    """

    # The class attributes' types are declared for type checkers only: a base class's string annotation
    # is evaluated in the globals of each subclass's module by ``get_type_hints(cls, globalns)``, the
    # call jsonargparse makes for a dataclass, and one name that module lacks (``PolicyFamily``) left
    # every field of HFEngineConfig, VLLMEngineConfig and SGLangEngineConfig unvalidated in YAML.
    if TYPE_CHECKING:
        family: ClassVar[PolicyFamily]
    family = "token"

    def validate(self, policy: Any, lora: Any = None) -> None:
        """Raise ``ValueError`` on the driver, before any worker starts, if this engine cannot serve
        ``policy`` with ``lora``; the default accepts everything."""

    def build(self, policy: Any, lora: Any = None) -> RolloutEngine:  # pragma: no cover - abstract
        raise NotImplementedError

    def with_cpu_threads(self, threads: int) -> EngineConfig:
        """This config with its CPU thread count set by the strategy's CPU rule, where it asks for it
        (``num_threads="auto"``); an engine that manages its own threads returns itself."""
        return self

    def for_placement(self, settings: Any) -> EngineConfig:
        """This config adapted to where the strategy runs it (``settings``: the strategy's rollout
        settings: ``placement``, ``shares_trainer_device``, ``in_process``, ``num_gpus_per_worker``,
        ``worker_layout``); the fields left None for the strategy to decide are decided here, once per
        engine. The default needs nothing and returns itself."""
        return self


class TorchThreadsEngineConfig(EngineConfig):
    """Base of the configs whose engine runs torch in the worker process itself (HF, diffusion): their
    ``num_threads`` field (``"auto"`` = the strategy's CPU rule) sets its intra-op threads."""

    if TYPE_CHECKING:  # declared for type checkers only (see EngineConfig); each subclass's field
        num_threads: int | Literal["auto"] | None

    def with_cpu_threads(self, threads: int) -> EngineConfig:
        return dataclasses.replace(self, num_threads=threads) if self.num_threads == "auto" else self


ENGINES: dict[str, tuple[str, str]] = {
    "hf": ("unirl_lightning.engines.hf", "HFEngineConfig"),
    "vllm": ("unirl_lightning.engines.vllm", "VLLMEngineConfig"),
    "sglang": ("unirl_lightning.engines.sglang", "SGLangEngineConfig"),
    "diffusion": ("unirl_lightning.engines.diffusion", "DiffusionEngineConfig"),
}
EngineName = Literal["auto", "hf", "vllm", "sglang", "diffusion"]


def check_engine_name(name: str) -> str:
    """``name`` if it names an engine (or ``"auto"``), else ``ValueError`` listing them and the extras."""
    if name != "auto" and name not in ENGINES:
        raise ValueError(
            f"engine must be one of {('auto', *ENGINES)} or an EngineConfig, got {name!r} (vllm needs "
            "pip install 'unirl-lightning[vllm]', sglang needs pip install 'unirl-lightning[sglang]')"
        )
    return name


def engine_name(engine: str | EngineConfig) -> str:
    """The name :data:`ENGINES` gives ``engine``: a name as given; a config by its class, or the first
    of its base classes, that :data:`ENGINES` lists; else its class name."""
    if isinstance(engine, str):
        return engine
    for cls in type(engine).__mro__:
        for name, (module, class_name) in ENGINES.items():
            if cls.__module__ == module and cls.__name__ == class_name:
                return name
    return type(engine).__name__


def resolve_engine(engine: str | EngineConfig, default: str, family: PolicyFamily) -> EngineConfig:
    """The engine config for ``engine`` (a name, ``"auto"`` = ``default``, or a config), checked
    against the policy ``family`` the module trains."""
    if isinstance(engine, str):
        name = default if check_engine_name(engine) == "auto" else engine
        module, cls = ENGINES[name]
        engine = getattr(importlib.import_module(module), cls)()
    if not isinstance(engine, EngineConfig):
        raise TypeError(f"engine must be a name or an EngineConfig, got {type(engine).__name__}")
    if engine.family != family:
        raise ValueError(
            f"engine {type(engine).__name__} serves {engine.family} policies, but the module trains a "
            f"{family} policy: use engine='auto' (= {default!r})"
        )
    return engine


def import_backend(module: str, engine: str, install_hint: str) -> Any:
    """``import module``, or an ImportError naming the engine and the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"the {engine} engine needs {engine}, which is not installed: {install_hint}"
        ) from exc


def engine_device(device: str, num_threads: int | str | None) -> torch.device:
    """Set the worker's torch threads (None, or an ``"auto"`` no strategy resolved: torch's default)
    and resolve the device ``"auto"`` to cuda or cpu."""
    if isinstance(num_threads, int) and num_threads > 0:
        torch.set_num_threads(num_threads)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def check_context(prompt_len: int, max_new_tokens: int, limit: int | None, limit_name: str) -> None:
    """Refuse a request whose longest prompt (``prompt_len`` tokens) plus ``max_new_tokens`` does not
    fit the model's ``limit`` positions (``limit_name`` says which limit: ``max_position_embeddings``,
    ``max_model_len``); ``ValueError`` naming the three numbers. ``limit`` None: nothing to check."""
    if limit is not None and prompt_len + max_new_tokens > limit:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} plus the longest prompt ({prompt_len} tokens) is "
            f"{prompt_len + max_new_tokens} positions, beyond the model's {limit_name}={limit}: lower "
            f"max_new_tokens to at most {max(0, limit - prompt_len)} or use shorter prompts"
        )


def check_sampling_overrides(overrides: dict[str, Any], owned: tuple[str, ...]) -> None:
    """``ValueError`` naming the keys of ``overrides`` the engine sets itself (give them on the module)."""
    clash = sorted(set(overrides) & set(owned))
    if clash:
        raise ValueError(
            f"sampling_overrides must not set {clash}: the engine sets them from the module's sampling "
            "(model.init_args: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens, stop)"
        )


def trim_at_stop(tokens: list[int], stop_ids: Sequence[int]) -> tuple[list[int], FinishReason]:
    """Cut a sampled row at its first stop token (kept, so the policy learns to stop)."""
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: i + 1], "stop"
    return tokens, "length"


def make_group(
    request: RolloutRequest,
    group_id: int,
    prompt_ids: list[int],
    samples: Iterable[tuple[list[int], list[float], FinishReason]],
    tokenizer: Any,
    weight_version: int,
) -> list[Rollout]:
    """One group of :class:`Rollout` s for record ``group_id`` of ``request`` from its sampled
    ``(completion_ids, logprobs, finish_reason)`` triples; text is decoded without special tokens."""
    record = request.records[group_id]
    return [
        Rollout(
            prompt_ids=list(prompt_ids),
            completion_ids=completion,
            logprobs=logprobs,
            reward=0.0,
            finish_reason=finish,
            text=tokenizer.decode(completion, skip_special_tokens=True),
            prompt=record["prompt"],
            group_id=group_id,
            gen_id=request.gen_id,
            weight_version=weight_version,
        )
        for completion, logprobs, finish in samples
    ]


class RowGeneration:
    """The request-grouping default of the engines that sample one row per completion from token ids
    (vLLM, SGLang): each record's prompt ids are repeated ``n`` times, the rows go to the engine's
    ``generate_ids(rows, sampling, seed)`` (row ``i`` seeded ``derive_seed(seed, i)``), and the samples
    come back as one group per record. The HF engine keeps its own group-aligned, chunk-seeded batches.
    """

    def generate(self, request: RolloutRequest) -> list[list[Rollout]]:
        tok = self.tokenizer  # type: ignore[attr-defined]
        n = request.n
        prompt_ids = [self.policy.prompt_ids(tok, record) for record in request.records]  # type: ignore[attr-defined]
        rows = [ids for ids in prompt_ids for _ in range(n)]
        samples = self.generate_ids(rows, request.sampling, request.seed)  # type: ignore[attr-defined]
        version = self.weight_version  # type: ignore[attr-defined]
        return [
            make_group(request, i, ids, samples[i * n : (i + 1) * n], tok, version)
            for i, ids in enumerate(prompt_ids)
        ]


def generate_chunk(engine: Any, request: RolloutRequest) -> list[list[Rollout]]:
    """One chunk of an interruptible generation (``request.chunk_tokens`` set), for any token engine
    with ``generate_ids(rows, sampling, seed)`` (HF, vLLM, SGLang): the mechanism of
    ``sync_mode="interrupt"`` is a token budget per call, so an in-flight call ends within
    ``chunk_tokens`` decode steps and no engine needs an abort that would queue behind ``generate``.

    Each row of ``request.partial`` is continued from prompt + its partial completion (re-encoded as
    prompt ids, so the KV cache of the prefix is recomputed with the weights the engine holds now)
    for ``min(chunk_tokens, max_new_tokens - len(partial))`` new tokens. Returns one group per record
    with one rollout per row, in row order: the completion, behaviour log-probs and token versions so
    far (prefix + new, aligned token by token; the new tokens carry ``engine.weight_version``), and
    ``finish_reason`` ``"stop"``, ``"length"`` (the sample's whole budget is spent) or ``"aborted"``
    (only this chunk's budget is: not finished, never scored or trained). Rows with the same budget
    are sampled in one ``generate_ids`` call, the ``k``-th seeded ``derive_seed(seed, k)``.

    Raises ``ValueError`` when ``chunk_tokens`` or ``partial`` is missing, or a row has no budget left.
    """
    if request.chunk_tokens is None or request.partial is None:
        raise ValueError("generate_chunk needs a chunk request: chunk_tokens and partial set")
    tok = engine.tokenizer
    sampling, chunk = request.sampling, request.chunk_tokens
    prompts = [engine.policy.prompt_ids(tok, record) for record in request.records]
    by_budget: dict[int, list[tuple[int, int]]] = {}  # budget -> (record, row) positions
    for index, rows in enumerate(request.partial):
        for position, row in enumerate(rows):
            left = sampling.max_new_tokens - len(row.completion_ids)
            if left < 1:
                raise ValueError(
                    f"row {row.sample} of record {index} has {len(row.completion_ids)} tokens, the whole "
                    f"max_new_tokens={sampling.max_new_tokens}: it is finished, not a chunk to continue"
                )
            by_budget.setdefault(min(chunk, left), []).append((index, position))
    out: dict[tuple[int, int], Rollout] = {}
    version = engine.weight_version
    for call, (budget, positions) in enumerate(sorted(by_budget.items())):
        rows = [request.partial[i][p] for i, p in positions]
        inputs = [prompts[i] + list(row.completion_ids) for (i, _), row in zip(positions, rows)]
        seed = None if request.seed is None else derive_seed(request.seed, call)
        samples = engine.generate_ids(inputs, dataclasses.replace(sampling, max_new_tokens=budget), seed)
        for (index, position), row, (new_ids, new_logps, finish) in zip(positions, rows, samples):
            completion = list(row.completion_ids) + list(new_ids)
            text = tok.decode(completion, skip_special_tokens=True)
            if finish == "length" and len(completion) < sampling.max_new_tokens:
                # a stop string that ends exactly at the chunk's budget leaves no padding to tell it
                finish = "stop" if any(text.endswith(stop) for stop in sampling.stop) else "aborted"
            out[index, position] = Rollout(
                prompt_ids=list(prompts[index]),
                completion_ids=completion,
                logprobs=list(row.logprobs) + list(new_logps),
                token_versions=list(row.token_versions) + [version] * len(new_ids),
                reward=0.0,
                finish_reason=finish,
                text=text,
                prompt=request.records[index]["prompt"],
                group_id=index,
                gen_id=request.gen_id,
                weight_version=version,
            )
    return [[out[index, p] for p in range(len(rows))] for index, rows in enumerate(request.partial)]


def generate_chunks(engine: Any, request: RolloutRequest) -> list[list[Rollout]]:
    """The worker's side of ``sync_mode="interrupt"``: :func:`generate_chunk` again and again over the
    rows not finished yet, until every row has finished or ``request.interrupt_signal`` fires
    (checked before every chunk, so a request queued behind another returns at once); without a
    signal, one chunk. Same answer shape as :func:`generate_chunk`: one rollout per row sent, the
    unfinished ones ``"aborted"`` with the tokens they have so far (possibly none). Chunk ``k`` is
    seeded ``derive_seed(seed, k)``."""
    from unirl_lightning.rollout.records import PartialRow

    signal, epoch = request.interrupt_signal, request.interrupt_epoch
    rows = {(i, p): row for i, group in enumerate(request.partial or []) for p, row in enumerate(group)}
    done: dict[tuple[int, int], Rollout] = {}
    for call in range(1 << 30):
        if not rows or (signal is not None and signal.fired(epoch)) or (signal is None and call == 1):
            break
        keys = sorted(rows)
        indices = sorted({i for i, _ in keys})
        chunk = dataclasses.replace(
            request,
            records=[request.records[i] for i in indices],
            partial=[[rows[k] for k in keys if k[0] == i] for i in indices],
            seed=None if request.seed is None else derive_seed(request.seed, call),
        )
        answers = [r for group in generate_chunk(engine, chunk) for r in group]
        for key, rollout in zip([k for i in indices for k in keys if k[0] == i], answers):
            if rollout.finish_reason == "aborted":
                rows[key] = PartialRow(
                    rows[key].sample, rollout.completion_ids, rollout.logprobs, rollout.versions()
                )
            else:
                del rows[key]
                done[key] = rollout
    for (index, position), row in rows.items():  # interrupted: what each unfinished row has so far
        done[index, position] = Rollout(
            prompt_ids=list(engine.policy.prompt_ids(engine.tokenizer, request.records[index])),
            completion_ids=list(row.completion_ids),
            logprobs=list(row.logprobs),
            token_versions=list(row.token_versions),
            reward=0.0,
            finish_reason="aborted",
            prompt=request.records[index]["prompt"],
            group_id=index,
            gen_id=request.gen_id,
            weight_version=engine.weight_version,
        )
    return [[done[i, p] for p in range(len(group))] for i, group in enumerate(request.partial or [])]


ENGINE_DEAD_ERRORS = ("EngineDeadError",)
"""The names of the exceptions by which a serving engine says it can serve no more (vLLM's
``EngineDeadError``: its engine core process died): the worker holding it is as good as dead. Matched
by name over the exception's classes, so the driver needs no engine installed."""


def is_engine_dead(error: BaseException | None) -> bool:
    """Whether ``error`` (or a class it derives from) is one of :data:`ENGINE_DEAD_ERRORS`.

    >>> class EngineDeadError(RuntimeError): ...
    >>> is_engine_dead(EngineDeadError("core died")), is_engine_dead(ValueError())
    (True, False)
    """
    return error is not None and any(cls.__name__ in ENGINE_DEAD_ERRORS for cls in type(error).__mro__)
