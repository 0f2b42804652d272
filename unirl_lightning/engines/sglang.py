"""The SGLang engine: an offline ``sglang.Engine`` inside a rollout worker (a Ray actor).

Called inside a worker, one call at a time, like every engine (see :mod:`unirl_lightning.engines.base`).
Guarantees, beyond the contract:

* **Log-probs.** Requests ask for ``return_logprob=True`` (output tokens only). SGLang's sampler
  reports ``log(softmax(logits / temperature))`` of the sampled token, before top-p/top-k: the
  distribution the trainer recomputes (greedy: temperature 1, like the HF engine). The engine must not
  run with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (that reports temperature-1 log-probs); it refuses to
  start if it is set. Completions are the token ids SGLang reports next to those log-probs, cut after
  the first eos (kept), so ids, log-probs and ``finish_reason`` line up exactly as in the HF engine.
* **Sampling**: every option of :class:`~unirl_lightning.rollout.records.SamplingParams` maps onto
  SGLang's sampling parameters (:func:`sglang_sampling_params`; ``top_k`` 0 = off is SGLang's -1);
  ``sampling_overrides`` adds SGLang-only ones, refusing those the engine owns. A request whose
  longest prompt plus ``max_new_tokens`` exceeds SGLang's context length is refused naming the numbers.
* **Prompts** are tokenised here (``add_special_tokens=False``) and sent as ``input_ids``; completions
  are decoded with the policy's tokenizer. Each record's ``n`` samples are ``n`` requests. Seeds: SGLang
  honours per-request seeds only in deterministic mode (``deterministic=True``, i.e.
  ``enable_deterministic_inference``): then record ``i``'s ``j``-th sample (sample ``k = i * n + j``)
  uses :func:`~unirl_lightning.core.seeding.derive_seed` ``(seed, k)``; otherwise sampling draws
  from the engine's ``random_seed`` stream.
* **Multi-turn** (agentic episodes): ``generate_ids`` takes token ids (every episode's whole context
  so far) and returns one sample per row with the same log-prob and stop rules; ``generate`` is
  ``generate_ids`` over each record's ``n`` copies of its prompt.
* **Full-weight updates**: generation is paused (``pause_generation(mode="retract")``), and inside one
  weight-update session (``begin_weight_update`` .. ``end_weight_update``, which SGLang 0.5.23 requires)
  the tensors go through ``Engine.update_weights_from_tensor`` in buckets of at most ``bucket_mb`` (a decoder layer is
  never split; on CUDA each bucket is moved to the GPU first, so SGLang receives it by CUDA IPC), the
  radix (prefix) cache is flushed with the last bucket, and generation continues. The worker does not
  generate while it loads (one call at a time), so the pause is a guard, not a drain.
  For a trainer that broadcasts over NCCL instead, SGLang's documented alternative is
  ``Engine.init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name)``
  once, then per bucket ``Engine.update_weights_from_distributed(names, dtypes, shapes, group_name)``
  while the trainer broadcasts the same tensors in the same order, inside the same weight-update
  session (:func:`weight_update_session`: 0.5.23 refuses the call outside one); the engine exposes
  SGLang's ``Engine`` as ``self.engine`` for a weight-sync backend that wants that path.
* **LoRA updates** (``lora`` set): the pushed tensors are the ``peft`` adapter only; each version is
  loaded with ``Engine.load_lora_adapter_from_tensors`` under a fresh name (no file is written) and the
  previous adapter is unloaded. Until the first adapter push the base model generates.
* **Sleep/wake** use ``release_memory_occupation`` / ``resume_memory_occupation`` when the engine
  runs with ``enable_memory_saver`` (on by default where the engine shares the trainer's GPU:
  ``placement="colocate"`` or ``"hybrid"``; ``torch_memory_saver`` comes with SGLang); otherwise both
  are no-ops, and SGLang keeps ``mem_fraction_static`` of the memory free at its start for the run.
* **Devices.** SGLang runs on CUDA only: its workers must hold GPUs (``num_gpus_per_worker`` of at
  least ``tp_size``; refused otherwise when the strategy places it), and its scheduler starts at the
  process's current CUDA device (``base_gpu_id``: the rank's device in the training process under
  ``"hybrid"``, device 0 of a Ray worker). A float32 policy (TinyCausalLM) is served with the Triton
  attention backend unless ``engine_kwargs`` names one: SGLang's Hopper default (FA3), like
  FlashInfer, takes 16-bit inputs only. Under ``"hybrid"``, one training rank only:
  ``Engine.shutdown()`` kills every child process of the process that runs it.

``sglang`` is imported only inside :meth:`SGLangEngineConfig.build`, so this module imports without
it. SGLang has no CPU build on PyPI: its tests are in ``tests/gpu`` (``@pytest.mark.gpu``).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from unirl_lightning.core.checks import require_choice, require_in_range, require_positive
from unirl_lightning.core.device_rules import sglang_gpu_error
from unirl_lightning.core.seeding import derive_seeds
from unirl_lightning.engines.base import (
    EngineConfig,
    RowGeneration,
    check_context,
    check_sampling_overrides,
    import_backend,
    trim_at_stop,
)
from unirl_lightning.engines.serving import (
    check_checkpoint_names,
    lora_adapter_config,
    materialize_policy,
)
from unirl_lightning.engines.sglang_args import (
    OWNED_SAMPLING_KEYS,
    sglang_engine_kwargs,
    sglang_sampling_params,
)
from unirl_lightning.models.causal_lm import PolicySpec
from unirl_lightning.models.lora import LoraSpec, is_lora_push
from unirl_lightning.rollout.records import FinishReason, SamplingParams
from unirl_lightning.weight_sync.buckets import weight_buckets

__all__ = [
    "SGLangEngine",
    "SGLangEngineConfig",
    "import_sglang",
    "sglang_completion",
    "sglang_sampling_params",
    "weight_update_session",
]

log = logging.getLogger(__name__)

INSTALL_HINT = "install the extra: pip install 'unirl-lightning[sglang]' (SGLang needs a CUDA GPU)"


def import_sglang() -> Any:
    """``import sglang``, or an ImportError that names the extra to install."""
    return import_backend("sglang", "SGLang", INSTALL_HINT)


@dataclass
class SGLangEngineConfig(EngineConfig):
    """Configuration of the SGLang engine (offline ``sglang.Engine`` in the rollout worker).

    The policy and its LoRA spec are the module's (with LoRA, pushes are adapter-only).

    Args:
        bucket_mb: largest weight bucket per ``update_weights_from_tensor`` call (a layer is never split).
        mem_fraction_static: fraction of GPU memory SGLang takes for weights + KV cache.
        tp_size: GPUs per engine (tensor parallel).
        context_length: longest prompt + completion; None = the model's own limit.
        dtype: None = the policy's dtype (float32 for TinyCausalLM).
        random_seed: the engine's sampling seed.
        deterministic: SGLang's deterministic inference (batch-invariant kernels; per-request seeds).
        enable_memory_saver: lets ``sleep()`` release GPU memory; None = on where the engine shares
            the trainer's GPU (``placement="colocate"`` / ``"hybrid"``), off elsewhere.
        engine_kwargs: anything else for ``sglang.Engine(...)`` (wins over the fields above).
        sampling_overrides: extra SGLang sampling parameters of every request (e.g.
            ``{"presence_penalty": 0.5}``); the ones the engine sets from the module's sampling are
            refused.
        batching: ``"static"`` (one blocking ``Engine.generate`` per call) or ``"continuous"`` (calls
            join SGLang's running batch and a push pauses it in place: see
            :mod:`~unirl_lightning.engines.sglang_async`). ``sync_mode="continue"`` needs it.
        concurrent_calls: continuous only: generate calls one Ray worker takes at once.

    Example::

        AsyncRolloutStrategy(engine=SGLangEngineConfig(mem_fraction_static=0.4))   # YAML: engine: sglang
    """

    bucket_mb: float = 512
    mem_fraction_static: float = 0.5
    tp_size: int = 1
    context_length: int | None = None
    dtype: str | None = None
    random_seed: int = 0
    deterministic: bool = False
    enable_memory_saver: bool | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    sampling_overrides: dict[str, Any] = field(default_factory=dict)
    batching: Literal["static", "continuous"] = "static"
    concurrent_calls: int = 64

    def __post_init__(self) -> None:
        check_sampling_overrides(self.sampling_overrides, OWNED_SAMPLING_KEYS)
        require_positive("bucket_mb", self.bucket_mb)
        require_in_range("mem_fraction_static", self.mem_fraction_static, 0, 1, low_open=True, high_open=True)
        require_choice("batching", self.batching, ("static", "continuous"))
        require_positive("concurrent_calls", self.concurrent_calls)

    @property
    def loads_in_flight(self) -> bool:
        """Whether weights can land while rows are mid-generation (they continue in place):
        ``sync_mode="continue"`` needs it."""
        return self.batching == "continuous"

    @property
    def max_concurrency(self) -> int:
        """Calls one Ray worker runs at once (its actor's ``max_concurrency``)."""
        return self.concurrent_calls if self.batching == "continuous" else 1

    def for_placement(self, settings: Any) -> SGLangEngineConfig:
        """The memory saver on where the engine shares the trainer's GPU (unless set); a Ray worker
        that holds no GPU, or fewer than ``tp_size``, refused (SGLang has no CPU path: its scheduler
        would die on an empty ``CUDA_VISIBLE_DEVICES``)."""
        error = sglang_gpu_error(
            settings.placement, settings.num_gpus_per_worker, settings.worker_layout, self.tp_size
        )
        if error is not None:
            raise ValueError(error)
        if self.enable_memory_saver is None:
            return dataclasses.replace(self, enable_memory_saver=bool(settings.shares_trainer_device))
        return self

    def build(self, policy: PolicySpec, lora: LoraSpec | None = None) -> SGLangEngine:
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
            raise ValueError(
                "SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would report temperature-1 log-probs, not "
                "the temperature-scaled ones the trainer recomputes; unset it"
            )
        import_sglang()
        if not torch.cuda.is_available():
            raise RuntimeError(
                "engine='sglang' needs a CUDA GPU in the process that runs it, and none is visible here "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): give its workers GPUs "
                "(num_gpus_per_worker), or use engine='hf' or 'vllm'"
            )
        if self.batching == "continuous":  # an SGLangEngine subclass, found by module name as ENGINES are
            module = importlib.import_module("unirl_lightning.engines.sglang_async")
            return module.AsyncSGLangEngine(self, policy, lora)
        return SGLangEngine(self, policy, lora)


class SGLangEngine(RowGeneration):
    """Generates groups with ``sglang.Engine.generate``; see the module docstring for the contract."""

    def __init__(self, config: SGLangEngineConfig, policy: PolicySpec, lora: LoraSpec | None) -> None:
        self.config = config
        self.lora = lora
        self.policy = policy
        self.weight_version = 0
        self._tmp = tempfile.mkdtemp(prefix="unirl-sglang-")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._tmp, True)
        self._asleep = False
        self._lora_name: str | None = None
        self._lora_count = 0
        served = materialize_policy(policy, self._tmp)
        check_checkpoint_names(served, "sglang")
        self.model_path, self.tokenizer = served.path, served.tokenizer
        self.engine = self._start(sglang_engine_kwargs(config, served, lora))

    def _start(self, kwargs: dict[str, Any]) -> Any:
        """The ``sglang.Engine``; the continuous engine creates it on a loop thread instead."""
        import sglang

        return sglang.Engine(**kwargs)

    # -- weights ---------------------------------------------------------------------------------
    @contextmanager
    def paused(self):
        """Pause SGLang's scheduler (running requests are retracted) and continue after the block."""
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

        manager, loop = self.engine.tokenizer_manager, self.engine.loop
        loop.run_until_complete(manager.pause_generation(PauseGenerationReqInput(mode="retract")))
        try:
            yield
        finally:
            loop.run_until_complete(manager.continue_generation(ContinueGenerationReqInput()))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> None:
        self.wake()
        items = list(named_tensors)
        lora = is_lora_push(items)
        if lora and self.lora is None:
            raise ValueError(
                "got LoRA adapter tensors but this engine was built without a LoraSpec (the module's lora "
                "is None)"
            )
        with self.paused():  # the version is set before generation continues under it
            if lora:
                self._load_lora(items, weight_version)
            else:
                self._load_full(items)
            self.weight_version = weight_version

    def _load_full(self, items: list[tuple[str, torch.Tensor]], flush_cache: bool = True) -> None:
        """The buckets inside one weight-update session (SGLang >= 0.5.23 refuses a tensor update
        outside ``begin_weight_update()`` .. ``end_weight_update()``), the cache flushed with the last."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        buckets = list(weight_buckets(items, int(self.config.bucket_mb * 1024**2), whole_layers=True))
        with weight_update_session(self.engine):
            for index, bucket in enumerate(buckets):
                moved = [(name, t.to(device, non_blocking=True)) for name, t in bucket]
                result = self.engine.update_weights_from_tensor(
                    named_tensors=moved, flush_cache=flush_cache and index == len(buckets) - 1
                )
                _check(result, f"update_weights_from_tensor (bucket {index + 1}/{len(buckets)})")

    def _load_lora(self, items: list[tuple[str, torch.Tensor]], weight_version: int) -> None:
        tensors = {name: t.detach().contiguous() for name, t in items}
        adapter = lora_adapter_config(tensors, self.lora, self.model_path)
        self._lora_count += 1
        name = f"policy-v{weight_version}-{self._lora_count}"
        _check(
            self.engine.load_lora_adapter_from_tensors(name, tensors, adapter),
            "load_lora_adapter_from_tensors",
        )
        previous, self._lora_name = self._lora_name, name
        if previous is not None:
            _check(self.engine.unload_lora_adapter(previous), "unload_lora_adapter")
        self.engine.flush_cache()

    def sleep(self) -> None:
        if self.config.enable_memory_saver and not self._asleep:
            self.engine.release_memory_occupation()
            self._asleep = True

    def wake(self, tags: list[str] | None = None) -> None:
        """Resume all of SGLang's memory on the first call (``tags`` are ignored: a resume of part of
        it would leave the rest, e.g. CUDA graphs, released); later calls are no-ops."""
        if self._asleep:
            self.engine.resume_memory_occupation()
            self._asleep = False

    def close(self) -> None:
        """Shut SGLang's processes down and remove the temporary model files."""
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            engine.shutdown()
        self._cleanup()

    # -- generation ------------------------------------------------------------------------------
    def _requests(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int | None
    ) -> tuple[list[int], list[dict[str, Any]]]:
        """Wake the engine, check the context, and build every row's sampling parameters (seeded in
        deterministic mode); returns ``(stop_ids, params)``."""
        self.wake()
        stop_ids = self.policy.stop_ids(self.tokenizer)
        limit = getattr(getattr(self.engine, "tokenizer_manager", None), "context_len", None)
        if prompt_ids:
            check_context(max(len(r) for r in prompt_ids), sampling.max_new_tokens, limit, "context_length")
        seeds = derive_seeds(seed if self.config.deterministic else None, len(prompt_ids))
        overrides = self.config.sampling_overrides
        return stop_ids, [
            sglang_sampling_params(sampling, stop_ids, row_seed, overrides) for row_seed in seeds
        ]

    def generate_ids(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int | None = None
    ) -> list[tuple[list[int], list[float], FinishReason]]:
        """The token-level entry point (the agentic coordinator's): one sample per row of
        ``prompt_ids`` (token ids, any lengths), as ``(completion_ids, logprobs, finish_reason)``.
        The ids go to SGLang as they are, so earlier turns of an episode are never re-tokenized; in
        deterministic mode row ``i`` is seeded with ``derive_seed(seed, i)``."""
        stop_ids, params = self._requests(prompt_ids, sampling, seed)
        kwargs: dict[str, Any] = {}
        if self._lora_name is not None:
            kwargs["lora_path"] = [self._lora_name] * len(prompt_ids)
        outputs = self.engine.generate(
            input_ids=prompt_ids, sampling_params=params, return_logprob=True, **kwargs
        )
        return [sglang_completion(output, stop_ids) for output in outputs]


def sglang_completion(output: dict[str, Any], stop_ids: list[int]) -> tuple[list[int], list[float], str]:
    """(token ids, their log-probs, finish reason) of one SGLang output, cut after the first stop token."""
    meta = output["meta_info"]
    pairs = [(int(token), float(logprob)) for logprob, token, *_ in meta["output_token_logprobs"]]
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else str(finish)
    if kind not in ("stop", "length"):
        raise RuntimeError(f"SGLang finished a sample with {finish!r}")
    tokens, trimmed = trim_at_stop([token for token, _ in pairs], stop_ids)
    kind = "stop" if trimmed == "stop" else kind  # SGLang's own "stop" (a stop string) stays one
    return tokens, [lp for _, lp in pairs[: len(tokens)]], kind


@contextmanager
def weight_update_session(engine: Any):
    """SGLang's weight-update session around a push (``begin_weight_update`` / ``end_weight_update``,
    closed even when a bucket fails); nothing on a version without sessions."""
    if not hasattr(engine, "begin_weight_update"):
        yield
        return
    _check(engine.begin_weight_update(), "begin_weight_update")
    try:
        yield
    except BaseException:
        engine.end_weight_update()  # closed; the bucket's error is the one raised
        raise
    _check(engine.end_weight_update(), "end_weight_update")


def _check(result: Any, what: str) -> None:
    """SGLang's control calls answer ``(success, message)`` or an object with ``success``."""
    if isinstance(result, tuple):
        success, message = result[0], result[1] if len(result) > 1 else ""
    else:
        success = getattr(result, "success", True)
        message = getattr(result, "error_message", "") or getattr(result, "message", "")
    if not success:
        raise RuntimeError(f"SGLang {what} failed: {message}")
