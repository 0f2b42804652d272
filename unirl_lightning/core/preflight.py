"""Setup rules as pure functions of the settings (standard library only: no torch, no Ray).

``fit`` applies each where it applies today (the CLI at parse time, the strategy's setup before any
worker starts, the weight push, the optimizer) and ``unirl-lightning plan`` applies the same
functions to a recipe without building anything, so no rule exists in one of them alone. A rule
returns the problem as a message naming the keys and the fix, or None when the settings are fine.
The rules about devices and engines (collective backends, tensor parallelism, vLLM's executor and
sleep level, checkpoint names, shared GPU memory) are :mod:`unirl_lightning.core.device_rules`'.
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
    "config_value",
    "fused_optimizer_allowed",
    "hybrid_engine_error",
    "sync_mode_placement_error",
    "multi_node_ray_error",
    "placement_schedule_error",
    "serving_engine",
    "precision_warning",
    "resolve_weight_sync_name",
    "sync_replacement_error",
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
"""How a weight sync treats the requests in flight: wait for them, interrupt and resume them, or
continue them in place under the new weights."""
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


def inflight_window_warning(
    launch_unit: str, max_staleness: int, max_inflight: int, sync_interval: int
) -> str | None:
    """With group launches ``max_inflight`` caps the groups in flight at that many steps' worth; below
    the ``(max_staleness + 1) x sync_interval`` steps' worth the staleness window admits, it holds the
    engines back before the window does (``rollout/window_headroom`` above 0, starved engines).

    >>> inflight_window_warning("group", 1, 2, 1) is None
    True
    >>> inflight_window_warning("group", 1, 2, 2)[:39]
    'max_inflight=2 caps the groups in fligh'
    """
    window = (max_staleness + 1) * sync_interval
    if launch_unit != "group" or max_staleness == 0 or max_inflight >= window:
        return None
    return (
        f"max_inflight={max_inflight} caps the groups in flight at {max_inflight} steps' worth, below the "
        f"{window} the staleness window admits ((max_staleness={max_staleness} + 1) x "
        f"WeightSyncCallback(every_n_steps={sync_interval})): the engines may wait on max_inflight rather "
        f"than on the window (rollout/window_headroom above 0); set max_inflight: {window}"
    )


def sync_mode_placement_error(sync_mode: str, placement: str) -> str | None:
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
    """``placement="hybrid"`` with vLLM or SGLang (``engine``: a name, or its config's class name or
    path) runs on one training rank. vLLM's engine core in a training process would build its parallel
    state over the trainer's process group (and tear it down when it closes), and its worker takes
    device 0 on every rank; SGLang's ``Engine.shutdown()`` kills every child process of the process
    that runs it (the other ranks Lightning started from rank 0, among them). Several ranks serve
    in-process with the HF engine, or with vLLM or SGLang in Ray workers."""
    name = serving_engine(engine)
    if placement not in IN_PROCESS_PLACEMENTS or name not in ("vllm", "sglang") or world_size <= 1:
        return None
    label, why = {
        "vllm": (
            "vLLM",
            "vLLM's in-process engine would build its parallel state over the trainer's process group and "
            "put every rank's worker on device 0",
        ),
        "sglang": (
            "SGLang",
            "SGLang's shutdown kills every child process of the training process, the other ranks among them",
        ),
    }[name]
    return (
        f"placement={placement!r} with engine={name!r} runs {label} in the training process of one rank "
        f"only, got {world_size} training ranks ({why}): use engine='hf' with several ranks, or "
        f"placement='colocate' ({label} in Ray workers on the training GPUs)"
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


def recipe_sync_every(config: Any) -> int:
    """A parsed fit config's weight-sync cadence: its ``WeightSyncCallback``'s ``every_n_steps`` (1
    without one)."""
    every = 1
    for callback in config_value(config, "trainer", "callbacks", default=None) or []:
        if str(config_value(callback, "class_path", default="")).endswith("WeightSyncCallback"):
            every = int(config_value(callback, "init_args", "every_n_steps", default=1) or 1)
    return every
