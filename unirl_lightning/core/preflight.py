"""Setup rules as pure functions of the settings (standard library only: no torch, no Ray).

``fit`` applies each where it applies today (the CLI at parse time, the strategy's setup before any
worker starts, the weight push, the optimizer) and ``unirl-lightning plan`` applies the same
functions to a recipe without building anything, so no rule exists in one of them alone. A rule
returns the problem as a message naming the keys and the fix, or None when the settings are fine.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

__all__ = [
    "IN_PROCESS_PLACEMENTS",
    "MIXED_PRECISIONS",
    "PLACEMENTS",
    "Placement",
    "SyncMode",
    "LaunchUnit",
    "launch_unit_error",
    "continue_engine_error",
    "WeightSyncName",
    "WorkerLayout",
    "SHARED_DEVICE_PLACEMENTS",
    "chat_template_warning",
    "checkpoint_names_error",
    "collective_backend",
    "config_value",
    "collective_device_error",
    "sleep_level_error",
    "vllm_executor_backend",
    "fused_optimizer_allowed",
    "hybrid_engine_error",
    "interrupt_placement_error",
    "multi_node_ray_error",
    "placement_schedule_error",
    "recipe_device_errors",
    "renamed_by_transformers",
    "serving_engine",
    "shared_gpu_memory_error",
    "precision_warning",
    "resolve_weight_sync_name",
    "sync_replacement_error",
    "tensor_parallel_size_for",
    "weight_sync_placement_error",
]

Placement = Literal["separate", "colocate", "hybrid"]
PLACEMENTS = get_args(Placement)
"""Where the engines run: ``separate`` (Ray workers on devices of their own), ``colocate`` (Ray workers
on the trainer's device, asleep while it trains), ``hybrid`` (the engine inside the training process,
on its device: no Ray)."""

SHARED_DEVICE_PLACEMENTS = frozenset({"colocate", "hybrid"})
"""The placements whose engines share the training device (generation and training take turns)."""

IN_PROCESS_PLACEMENTS = frozenset({"hybrid"})
"""The placements whose engine lives in the training process (weights move by an in-memory copy)."""

WeightSyncName = Literal["auto", "object_store", "collective", "inprocess"]
"""The weight-sync backends by name (``"auto"``: the placement's)."""
RAY_WEIGHT_SYNCS = ("object_store", "collective")
WorkerLayout = Literal["actor", "per_gpu"]
"""A GPU worker's placement group: one bundle (``"actor"``) or one per GPU (``"per_gpu"``)."""
IN_PROCESS_WEIGHT_SYNC = "inprocess"

MIXED_PRECISIONS = frozenset({"16-mixed", "bf16-mixed", "16", "bf16"})
"""Lightning's automatic-mixed-precision settings (``"16"`` and ``"bf16"`` are its old names for them)."""

LOW_PRECISION_DTYPES = frozenset({"bfloat16", "float16"})


SyncMode = Literal["quiesce", "interrupt", "continue"]
SYNC_MODES = get_args(SyncMode)
LaunchUnit = Literal["request", "group"]
LAUNCH_UNITS = get_args(LaunchUnit)


def launch_unit_error(launch_unit: str, sync_mode: str) -> str | None:
    """``launch_unit`` must be one of :data:`LAUNCH_UNITS`; ``"group"`` (one prompt's samples launched,
    reaped and buffered on their own) is not combined with ``sync_mode="interrupt"`` yet, whose chunks
    are per request."""
    if launch_unit not in LAUNCH_UNITS:
        return f"launch_unit must be one of {LAUNCH_UNITS}, got {launch_unit!r}"
    if launch_unit == "group" and sync_mode == "interrupt":
        return (
            "launch_unit='group' cannot be combined with sync_mode='interrupt' (interrupted chunks are per "
            "request): use sync_mode='quiesce' or launch_unit='request'"
        )
    return None


"""How a weight sync treats the requests in flight: wait for them, or interrupt and resume them."""


def interrupt_placement_error(sync_mode: str, placement: str) -> str | None:
    """``sync_mode`` must be one of :data:`SYNC_MODES`; ``"interrupt"`` resumes requests with new weights
    while the trainer goes on, which needs generators on devices of their own (``placement="separate"``):
    a colocated run is synchronous (nothing is in flight at a sync, there is nothing to interrupt)."""
    if sync_mode not in SYNC_MODES:
        return f"sync_mode must be one of {SYNC_MODES}, got {sync_mode!r}"
    if sync_mode in ("interrupt", "continue") and placement != "separate":
        return (
            f"sync_mode={sync_mode!r} needs placement='separate', got placement={placement!r}: "
            "generation goes on with new weights while the trainer trains, so it needs devices of its "
            "own; use sync_mode='quiesce' with this placement"
        )
    return None


def continue_engine_error(sync_mode: str, engine: object) -> str | None:
    """``sync_mode="continue"`` pushes weights while generation goes on, which only an engine that
    loads between two decode steps (every token keeping its version) may take: the HF, vLLM and
    SGLang engines with ``batching="continuous"``."""
    if sync_mode != "continue" or getattr(engine, "loads_in_flight", False):
        return None
    name = repr(engine) if isinstance(engine, str) else type(engine).__name__  # a name, or a config
    return (
        f"sync_mode='continue' pushes weights while generation goes on, and the engine "
        f"{name} does not load between decode steps: use "
        "an engine config with batching='continuous' (HFEngineConfig, VLLMEngineConfig or SGLangEngineConfig) "
        "or sync_mode='quiesce'"
    )


def sync_replacement_error(
    weight_sync: str, sharded: bool, world_size: int, max_worker_restarts: int
) -> str | None:
    """A model sharded over several ranks (FSDP) cannot feed a replaced worker over
    ``weight_sync="collective"``: a replacement is served by one rank alone, and this backend can
    only send it the weights by gathering the shards, a collective the other ranks are not in. The
    object store re-sends its last push instead; or no worker is ever replaced."""
    if weight_sync != "collective" or not sharded or world_size <= 1 or max_worker_restarts == 0:
        return None
    return (
        "weight_sync='collective' cannot feed a replaced rollout worker of a sharded (FSDP) model "
        f"over {world_size} ranks (it would gather the shards on one rank alone): use "
        "weight_sync='object_store', which re-sends its last push to a replacement, or "
        f"max_worker_restarts=0 (got {max_worker_restarts})"
    )


def multi_node_ray_error(num_nodes: int, ray_address: str | None) -> str | None:
    """Several nodes need a Ray cluster that spans them: a Ray the run starts lives on rank 0's node
    alone, so every node's workers would be checked against, and placed on, that node's spare GPUs."""
    if num_nodes <= 1 or ray_address:
        return None
    return (
        f"trainer.num_nodes={num_nodes} needs a Ray cluster spanning the nodes, but RAY_ADDRESS is not set (a Ray "
        "the run starts would live on rank 0's node only): start Ray on every node (ray start --head on one, "
        "ray start --address HEAD:6379 on the others, each with --num-gpus = the GPUs its training ranks leave) "
        "and set RAY_ADDRESS on every node (docs/gpus.md, Recipe 2)"
    )


def placement_schedule_error(placement: str, max_staleness: int, max_inflight: int) -> str | None:
    """An engine on the trainer's device (``colocate``, ``hybrid``) takes turns with training, so it
    cannot overlap them: synchronous settings only (``max_staleness=0, max_inflight=1``)."""
    if placement not in SHARED_DEVICE_PLACEMENTS or (max_staleness == 0 and max_inflight == 1):
        return None
    where = "in the training process" if placement in IN_PROCESS_PLACEMENTS else "on the same device"
    return (
        f"placement={placement!r} runs generation and training {where} in turn, so it cannot overlap "
        f"them: it needs max_staleness=0 and max_inflight=1, got max_staleness={max_staleness}, "
        f"max_inflight={max_inflight}; use placement='separate' for async training"
    )


def resolve_weight_sync_name(placement: str, weight_sync: str) -> str:
    """``weight_sync="auto"``: the backend that goes with the placement's worker group (``inprocess``
    for ``hybrid``, ``object_store`` for the Ray workers); any other name is returned as given."""
    if weight_sync != "auto":
        return weight_sync
    return IN_PROCESS_WEIGHT_SYNC if placement in IN_PROCESS_PLACEMENTS else "object_store"


def weight_sync_placement_error(placement: str, weight_sync: str) -> str | None:
    """The weight-sync backend goes with the worker group: an in-process engine (``hybrid``) takes
    the in-memory copy (``weight_sync="inprocess"``) and nothing else; Ray workers take
    ``object_store`` or ``collective``, never ``inprocess``. ``weight_sync`` is a backend's name
    (``"other"`` for a user's own backend object, which only Ray workers take)."""
    name = resolve_weight_sync_name(placement, weight_sync)
    if placement in IN_PROCESS_PLACEMENTS and name != IN_PROCESS_WEIGHT_SYNC:
        return (
            f"placement={placement!r} runs the engine in the training process, whose weights it reads in "
            f"memory: it needs weight_sync='inprocess' (or 'auto'), got weight_sync={weight_sync!r}"
        )
    if placement not in IN_PROCESS_PLACEMENTS and name == IN_PROCESS_WEIGHT_SYNC:
        return (
            f"weight_sync='inprocess' copies weights within the training process, but placement="
            f"{placement!r} runs the engines in Ray workers: use weight_sync='object_store' or "
            f"'collective' (or 'auto'), or placement='hybrid'"
        )
    return None


def hybrid_engine_error(placement: str, engine: str, world_size: int) -> str | None:
    """``placement="hybrid"`` with vLLM (``engine``: ``"vllm"``, or its config's class name or path) runs
    on one training rank: vLLM's engine core in a training process would build its parallel state over
    the trainer's process group (and tear it down when it closes), and its worker takes device 0 on
    every rank. Several ranks serve in-process with the HF engine, or with vLLM in Ray workers."""
    vllm = serving_engine(engine) == "vllm"
    if placement not in IN_PROCESS_PLACEMENTS or not vllm or world_size <= 1:
        return None
    return (
        f"placement={placement!r} with engine='vllm' runs vLLM in the training process of one rank only, "
        f"got {world_size} training ranks (vLLM's in-process engine would build its parallel state over "
        "the trainer's process group and put every rank's worker on device 0): use engine='hf' with "
        "several ranks, or placement='colocate' (vLLM in Ray workers on the training GPUs)"
    )


def fused_optimizer_allowed(precision: str | int | None) -> bool:
    """Whether the modules' AdamW may use its fused kernel under the trainer's ``precision``:
    Lightning's AMP plugin (``"16-mixed"``, ``"bf16-mixed"``) refuses to clip the gradients of an
    optimizer that unscales them itself, as the fused kernel does."""
    return str(precision) not in MIXED_PRECISIONS


def precision_warning(precision: str | int | None, policy_dtype: str | None) -> str | None:
    """A causal-LM module whose policy is bf16/fp16 already computes in that dtype under its own
    autocast over float32 masters; Lightning's mixed precision on top adds nothing but turns the
    fused AdamW off."""
    if fused_optimizer_allowed(precision) or policy_dtype not in LOW_PRECISION_DTYPES:
        return None
    return (
        f"trainer.precision={str(precision)!r} turns the fused AdamW off (Lightning's AMP refuses to clip a "
        f"fused optimizer), and the module already computes in its policy's dtype ({policy_dtype}) under "
        "autocast over float32 masters: set trainer.precision: 32-true"
    )


def chat_template_warning(chat: bool, has_chat_template: bool, name: str) -> str | None:
    """An instruct model (its tokenizer has a chat template) prompted with raw text rambles to the
    token budget."""
    if chat or not has_chat_template:
        return None
    return (
        f"policy {name!r} has a chat template but chat is off: its prompts are raw text, which an "
        "instruct model tends to answer at length, up to max_new_tokens: set policy.init_args.chat: true"
    )


COLLECTIVE_BACKENDS = ("auto", "gloo", "nccl")


def collective_backend(backend: str, trainer_device_type: str, actor_gpus: float) -> str:
    """The process-group backend of ``weight_sync="collective"``: ``"auto"`` is NCCL only when both ends
    hold a GPU (the trainer on CUDA, and each worker's actor at least one GPU of its own), else gloo
    through the host. ``actor_gpus`` is what the actor process itself holds: ``num_gpus_per_worker``
    under ``worker_layout="actor"``, 0 under ``"per_gpu"`` (vLLM's own workers hold the GPUs there)."""
    if backend != "auto":
        return backend
    return "nccl" if trainer_device_type == "cuda" and actor_gpus > 0 else "gloo"


def collective_device_error(
    placement: str, weight_sync: str, backend: str, trainer_device_type: str, actor_gpus: float
) -> str | None:
    """Where ``weight_sync="collective"`` cannot run. NCCL refuses two ranks of one group on one GPU
    (``ncclInvalidUsage``: "Duplicate GPU detected", seen on an H200 with NCCL 2.28), and under
    ``placement="colocate"`` the trainer rank and its engine share the GPU; and an NCCL end needs a GPU
    (a worker's actor that holds none cannot build ``ProcessGroupNCCL``)."""
    if weight_sync != "collective":
        return None
    if backend not in COLLECTIVE_BACKENDS:
        return f"weight_sync backend must be one of {COLLECTIVE_BACKENDS}, got {backend!r}"
    resolved = collective_backend(backend, trainer_device_type, actor_gpus)
    if placement == "colocate" and resolved == "nccl":
        return (
            "placement='colocate' with weight_sync='collective' puts the trainer rank and its engine in one NCCL "
            "group on the same GPU, which NCCL refuses (ncclInvalidUsage: Duplicate GPU detected): use "
            "weight_sync='object_store' (or 'auto') with placement='colocate', or placement='separate'"
        )
    if resolved == "nccl" and actor_gpus <= 0:
        return (
            "weight_sync=CollectiveWeightSync(backend='nccl') needs a GPU in every worker's actor, but the actors "
            f"hold none (num_gpus_per_worker={actor_gpus:g}, or worker_layout='per_gpu', whose GPUs belong to "
            "vLLM's own workers): use backend='auto' (gloo through the host here) or weight_sync='object_store'"
        )
    if resolved == "nccl" and trainer_device_type != "cuda":
        return (
            f"weight_sync=CollectiveWeightSync(backend='nccl') needs the trainer on a GPU, got {trainer_device_type!r}: "
            "use backend='auto' or 'gloo'"
        )
    return None


def tensor_parallel_size_for(num_gpus_per_worker: float, tensor_parallel_size: int | None = None) -> int:
    """The engine's ``tensor_parallel_size``: ``num_gpus_per_worker`` when unset (1 for a share of a
    GPU or none); when set, it must equal ``num_gpus_per_worker`` (1 also fits a share of a GPU)."""
    gpus = float(num_gpus_per_worker)
    follows = int(gpus) if gpus >= 1 and gpus.is_integer() else (1 if gpus < 1 else None)
    if tensor_parallel_size is None and follows is not None:
        return follows
    if tensor_parallel_size is not None and tensor_parallel_size == follows:
        return tensor_parallel_size
    raise ValueError(
        f"tensor_parallel_size={tensor_parallel_size} and num_gpus_per_worker={gpus:g} disagree: a worker needs "
        f"one whole GPU per tensor-parallel rank; set num_gpus_per_worker to the tensor_parallel_size, or leave "
        f"tensor_parallel_size unset (it then follows num_gpus_per_worker)"
    )


def vllm_executor_backend(tensor_parallel_size: int, worker_layout: str) -> str | None:
    """vLLM's ``distributed_executor_backend`` for an engine of ``tensor_parallel_size`` GPUs in a Ray
    worker. One GPU: None (vLLM's single-process executor). Several, ``worker_layout="actor"`` (the
    actor holds all of them in one bundle): ``"mp"``, vLLM's own processes inside the actor; vLLM's
    default there is its Ray executor (it sees the actor's placement group), which asks for one bundle
    per GPU and fails ("Placement group bundle cannot have more than 1 GPU"). ``"per_gpu"`` (a bundle
    per GPU, the actor holds none): ``"ray"``, vLLM's workers placed on those bundles."""
    if tensor_parallel_size <= 1:
        return None
    return "mp" if worker_layout == "actor" else "ray"


def sleep_level_error(sleep_level: int, lora: bool, sync_interval: int) -> str | None:
    """vLLM's ``sleep(level=2)`` keeps no copy of the weights (level 1 offloads them to the host), so
    the engine wakes with garbage unless a push restores every weight before it generates: a LoRA push
    restores only the adapters, and with ``WeightSyncCallback(every_n_steps > 1)`` the engine wakes
    between pushes. Both served garbage without an error (verl met the same)."""
    if sleep_level != 2:
        return None
    if lora:
        return (
            "engine sleep_level=2 drops the base weights at sleep and a LoRA push restores only the adapters: "
            "use sleep_level: 1 (weights offloaded to the host)"
        )
    if sync_interval > 1:
        return (
            f"engine sleep_level=2 drops the weights at sleep, and WeightSyncCallback(every_n_steps={sync_interval}) "
            "lets the engine wake without a push in between: use sleep_level: 1, or every_n_steps: 1"
        )
    return None


def renamed_by_transformers(model_type: str) -> bool:
    """Whether the installed transformers renames ``model_type``'s weights when it loads them (its
    checkpoint conversion mapping, transformers 5), so its ``state_dict()`` names are not the
    checkpoint's. The one rule input that is not standard library: transformers is imported here only."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers 4 renames nothing; no transformers: nothing to say
        return False
    return bool(get_checkpoint_conversion_mapping(model_type))


def checkpoint_names_error(model_type: str, renamed: bool, engine: str) -> str | None:
    """vLLM and SGLang load pushed weights by the checkpoint's names; transformers 5 renames some
    models' weights when it loads them (fused 3-D ``mlp.experts.gate_up_proj`` for mixtral, qwen2/3-MoE
    and deepseek; the language model under a prefix for gemma3 and llava-style models), so a push by
    ``state_dict()`` names would raise or leave weights unloaded. ``renamed``: transformers has a
    checkpoint conversion mapping for ``model_type``."""
    if not renamed or engine not in ("vllm", "sglang"):
        return None
    return (
        f"engine={engine!r} loads pushed weights by checkpoint names, but transformers renames the weights of "
        f"model_type={model_type!r} when it loads them (its checkpoint conversion mapping), so a push would not "
        "match vLLM's or SGLang's names: use engine='hf' for this model (a name mapping back to the checkpoint's "
        "layout is not built yet)"
    )


def serving_engine(engine: Any) -> str:
    """The engine a recipe names, as a short lowercase name: ``"vllm"``, ``"sglang"``, ``"hf"``, ... from
    a name (``"vllm"``), a config's class path (``...vllm.VLLMEngineConfig``) or a ``class_path`` node."""
    if not isinstance(engine, str):
        engine = str(config_value(engine, "class_path", default=""))
    return engine.rpartition(".")[2].removesuffix("EngineConfig").lower()


def config_value(node: Any, *keys: str, default: Any = None) -> Any:
    """``node[k1][k2]...`` of a parsed config (dicts or jsonargparse Namespaces), else ``default``."""
    for key in keys:
        node = node.get(key) if hasattr(node, "get") else None
        if node is None:
            return default
    return node


def recipe_device_errors(config: Any, trainer_on_cuda: bool) -> list[tuple[str, str]]:
    """The rules above that read a whole recipe (``fit`` at parse time, ``plan``): the collective
    weight sync's devices (:func:`collective_device_error`) and vLLM's ``sleep_level``
    (:func:`sleep_level_error`). Returns ``(key, message)`` pairs; ``config`` is a parsed fit config
    (dicts or Namespaces); ``trainer_on_cuda``: the training ranks run on GPUs."""
    rollout = config_value(config, "trainer", "strategy", "init_args", default={})
    placement = str(config_value(rollout, "placement", default="separate"))
    sync = config_value(rollout, "weight_sync", default="auto")
    kind, backend = (str(sync), "auto") if isinstance(sync, str) else ("other", "auto")
    if not isinstance(sync, str) and str(config_value(sync, "class_path", default="")).endswith(
        "CollectiveWeightSync"
    ):
        kind, backend = "collective", str(config_value(sync, "init_args", "backend", default="auto"))
    gpus = float(config_value(rollout, "num_gpus_per_worker", default=0) or 0)
    actor_gpus = gpus if config_value(rollout, "worker_layout", default="actor") == "actor" else 0.0
    errors = []
    error = collective_device_error(
        placement, kind, backend, "cuda" if trainer_on_cuda else "cpu", actor_gpus
    )
    if error:
        errors.append(("trainer.strategy.init_args.weight_sync", error))
    engine = config_value(rollout, "engine", default="auto")
    vllm = serving_engine(engine) == "vllm"
    if vllm and placement == "separate" and 0 < gpus < 1:  # engines packed on one GPU must split it
        utilization = (
            0.5 if isinstance(engine, str) else config_value(engine, "init_args", "gpu_memory_utilization")
        )
        packed = shared_gpu_memory_error(placement, 0, 0, 0, 0, 0, False, gpus, float(utilization or 0.5))
        if packed:
            errors.append(("trainer.strategy.init_args.engine.init_args.gpu_memory_utilization", packed))
    sleep_level = (
        1 if isinstance(engine, str) else int(config_value(engine, "init_args", "sleep_level", default=1))
    )
    every = 1
    for callback in config_value(config, "trainer", "callbacks", default=None) or []:
        if str(config_value(callback, "class_path", default="")).endswith("WeightSyncCallback"):
            every = int(config_value(callback, "init_args", "every_n_steps", default=1) or 1)
    lora = config_value(config, "model", "init_args", "lora", default=None) is not None
    error = sleep_level_error(sleep_level, lora, every)
    if error:
        errors.append(("trainer.strategy.init_args.engine.init_args.sleep_level", error))
    return errors


def shared_gpu_memory_error(
    placement: str,
    gpu_gib: float,
    engine_gib: float,
    masters_gib: float,
    frozen_gib: float,
    moments_gib: float,
    offload_optimizer: bool,
    num_gpus_per_worker: float,
    utilization: float,
) -> str | None:
    """Memory of one GPU that a vLLM engine shares. vLLM sizes its pool at start to
    ``gpu_memory_utilization x`` the GPU (``engine_gib``) and fails when that much is not free; under
    ``colocate`` / ``hybrid`` the trainer then already holds its float32 masters and frozen weights, and
    while the engine is awake again (it sleeps only while the trainer trains) also AdamW's two moments,
    unless ``offload_optimizer`` moves them to the host (colocate). With a share of a GPU per worker
    (``num_gpus_per_worker < 1``, separate placement) Ray packs ``1 / share`` engines on one GPU, each
    asking for its own ``gpu_memory_utilization`` of it."""
    if placement == "separate":
        if 0 < num_gpus_per_worker < 1 and utilization > num_gpus_per_worker:
            packed = int(1 / num_gpus_per_worker)
            return (
                f"num_gpus_per_worker={num_gpus_per_worker:g} packs {packed} vLLM engines on one GPU, each asking for "
                f"gpu_memory_utilization={utilization:g} of it ({packed * utilization:g} of the GPU in all): set "
                f"engine.init_args.gpu_memory_utilization to at most {num_gpus_per_worker:g}"
            )
        return None
    moments = 0.0 if offload_optimizer and placement == "colocate" else moments_gib
    held = masters_gib + frozen_gib + moments
    if held + engine_gib <= gpu_gib:
        return None
    room = max(0.0, (gpu_gib - held) / gpu_gib)
    offload = " or offload_optimizer: true," if placement == "colocate" and not offload_optimizer else ""
    return (
        f"placement={placement!r} puts the vLLM engine's {engine_gib:.1f} GiB (gpu_memory_utilization={utilization:g} "
        f"x {gpu_gib:g} GiB) beside the trainer's {held:.1f} GiB (float32 masters {masters_gib:.1f}, frozen weights "
        f"{frozen_gib:.1f}, AdamW moments {moments:.1f}) on one GPU: vLLM fails at start or at wake. Set "
        f"engine.init_args.gpu_memory_utilization below {room:.2f}{offload} or use placement='separate'"
    )
