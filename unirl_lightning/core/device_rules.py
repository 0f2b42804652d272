"""Setup rules about devices and engines, as pure functions of the settings (standard library only: no
torch, no Ray; transformers is imported by one rule, lazily): the collective weight sync's backend and
devices, tensor parallelism and vLLM's executor, ``sleep_level``, checkpoint names the engines load,
and the GPU memory a vLLM engine shares with the trainer.

The placement, sync and launch rules are :mod:`unirl_lightning.core.preflight`'s; ``fit`` and
``unirl-lightning plan`` apply both modules' functions, so no rule exists in one of them alone.
"""

from __future__ import annotations

from typing import Any

from unirl_lightning.core.preflight import (
    IN_PROCESS_PLACEMENTS,
    config_value,
    recipe_sync_every,
    serving_engine,
)

__all__ = [
    "COLLECTIVE_BACKENDS",
    "PACKED_SHARE",
    "checkpoint_names_error",
    "collective_backend",
    "collective_device_error",
    "nccl_cumem_setting",
    "recipe_device_errors",
    "renamed_by_transformers",
    "shared_gpu_memory_error",
    "sglang_gpu_error",
    "sleep_level_error",
    "tensor_parallel_size_for",
    "vllm_executor_backend",
]

COLLECTIVE_BACKENDS = ("auto", "gloo", "nccl")
PACKED_SHARE = 0.9
"""The part of its share of a GPU a packed vLLM engine may ask for: the rest holds its CUDA context,
cuBLAS handles and NCCL buffers (a few hundred MB to about 1 GB), which vLLM counts as taken."""


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
    (``ncclInvalidUsage``: "Duplicate GPU detected", seen on an H200 with NCCL 2.28): under
    ``placement="colocate"`` the trainer rank and its engine share the GPU, and with a share of a GPU
    per worker (``separate``) Ray may pack two workers of the group on one; and an NCCL end needs a GPU
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
    if placement == "separate" and resolved == "nccl" and 0 < actor_gpus < 1:
        return (
            f"weight_sync='collective' over NCCL with num_gpus_per_worker={actor_gpus:g}: Ray may pack several "
            "workers of one NCCL group on one GPU, which NCCL refuses (ncclInvalidUsage: Duplicate GPU "
            "detected): use CollectiveWeightSync(backend='gloo') or weight_sync='object_store', or give each "
            "worker a whole GPU"
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


def nccl_cumem_setting(engine: Any, weight_sync: str, backend: str, current: str | None) -> str | None:
    """The ``NCCL_CUMEM_ENABLE`` the trainer must take before its first NCCL communicator, or None
    when nothing needs setting. Two NCCL peers on one node that disagree on cuMem fail their P2P
    transport (NCCL's legacy CUDA IPC path: "Cuda failure 'invalid argument'" in ``p2p.cc``, or a hang),
    and SGLang's engine sets ``NCCL_CUMEM_ENABLE=0`` in its own process when it is unset. So a
    collective push into SGLang (``weight_sync="collective"``, backend NCCL or ``"auto"``) has the
    trainer take 0 too, unless ``current`` (the trainer's own value) is set; the workers get the
    trainer's value (:func:`~unirl_lightning.workers.cluster.worker_runtime_env`), which SGLang keeps."""
    if current is not None or weight_sync != "collective" or backend == "gloo":
        return None
    return "0" if serving_engine(engine) == "sglang" else None


def sglang_gpu_error(
    placement: str, num_gpus_per_worker: float, worker_layout: str, tp_size: int
) -> str | None:
    """SGLang runs on CUDA only: in a Ray worker (every placement but ``"hybrid"``) the actor itself
    must hold ``tp_size`` GPUs (Ray gives an actor of 0 GPUs an empty ``CUDA_VISIBLE_DEVICES``, and
    SGLang's scheduler dies on it)."""
    actor_gpus = float(num_gpus_per_worker) if worker_layout == "actor" else 0.0
    if placement in IN_PROCESS_PLACEMENTS or actor_gpus >= max(1, tp_size):
        return None
    layout = f", worker_layout={worker_layout!r}" if worker_layout != "actor" else ""
    return (
        f"engine='sglang' runs on CUDA GPUs that its Ray worker holds, but num_gpus_per_worker="
        f"{float(num_gpus_per_worker):g}{layout} gives each worker {actor_gpus:g}: set num_gpus_per_worker "
        f"to tp_size ({tp_size}) with worker_layout='actor', or use engine='hf' or 'vllm' (which run on CPU too)"
    )


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


def recipe_device_errors(config: Any, trainer_on_cuda: bool) -> list[tuple[str, str]]:
    """The rules above that read a whole recipe (``fit`` at parse time, ``plan``): the collective
    weight sync's devices (:func:`collective_device_error`), SGLang's GPUs (:func:`sglang_gpu_error`)
    and vLLM's ``sleep_level`` (:func:`sleep_level_error`). Returns ``(key, message)`` pairs; ``config`` is a parsed fit config
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
    if serving_engine(engine) == "sglang":
        tp_size = (
            1 if isinstance(engine, str) else int(config_value(engine, "init_args", "tp_size", default=1))
        )
        layout = str(config_value(rollout, "worker_layout", default="actor"))
        error = sglang_gpu_error(placement, gpus, layout, tp_size)
        if error:
            errors.append(("trainer.strategy.init_args.num_gpus_per_worker", error))
    sleep_level = (
        1 if isinstance(engine, str) else int(config_value(engine, "init_args", "sleep_level", default=1))
    )
    lora = config_value(config, "model", "init_args", "lora", default=None) is not None
    error = sleep_level_error(sleep_level, lora, recipe_sync_every(config))
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
    asking for its own ``gpu_memory_utilization`` of it; vLLM needs that much free at start after its
    CUDA context and handles, so each gets at most ``PACKED_SHARE`` of its share."""
    if placement == "separate":
        most = round(PACKED_SHARE * num_gpus_per_worker, 2)
        if 0 < num_gpus_per_worker < 1 and utilization > most:
            packed = int(1 / num_gpus_per_worker)
            return (
                f"num_gpus_per_worker={num_gpus_per_worker:g} packs {packed} vLLM engines on one GPU, each asking for "
                f"gpu_memory_utilization={utilization:g} of it ({packed * utilization:g} of the GPU in all, beside "
                f"each engine's CUDA context, which vLLM counts as taken): set "
                f"engine.init_args.gpu_memory_utilization to at most {most:g}"
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
