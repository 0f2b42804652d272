"""Where rollout workers run: GPUs kept from the trainer, placement groups, a placement report.

* :func:`local_ray_gpus`: "trainer devices are never given to workers": the visible GPUs
  (``CUDA_VISIBLE_DEVICES``, else ``0..count-1``) minus the training ranks' (``cuda:k`` is the k-th
  visible id). ``with only_gpus(ids): ray.init(num_gpus=len(ids))`` then hands out only those.
* :func:`place_workers`: one placement group per worker, ready within ``timeout_s`` or removed with a
  :class:`PlacementError` naming the ask and Ray's free resources (never a hang). Layout ``"actor"``:
  one bundle with the worker's CPUs and GPUs (the actor sees them all; vLLM with tensor_parallel_size
  > 1 then needs ``distributed_executor_backend="mp"``, as in a placement group it picks Ray's).
  Layout ``"per_gpu"``: a bundle per GPU, ``STRICT_PACK`` (one node); the actor holds no GPU and its
  child tasks and actors (vLLM's Ray executor) take the bundles' GPUs.
* :func:`actor_placement_info` (in any actor), :func:`placement_report` (``placement.json`` + a table).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from unirl_lightning.core.device_rules import tensor_parallel_size_for  # noqa: F401 - its public home before it moved
from unirl_lightning.core.preflight import WorkerLayout

_EPS = 1e-9


class PlacementError(RuntimeError):
    """The rollout workers cannot be placed: the message names what was asked and what is free."""


def visible_gpu_ids(cuda_visible_devices: str | None, device_count: int = 0) -> list[str]:
    """The GPU ids this process sees, in CUDA's order: ``CUDA_VISIBLE_DEVICES`` split (numbers or
    UUIDs; ``""`` = none), else ``0..device_count-1`` when it is unset (``None``)."""
    if cuda_visible_devices is not None:
        return [part.strip() for part in cuda_visible_devices.split(",") if part.strip()]
    return [str(i) for i in range(device_count)]


def cuda_index(device: Any) -> int | None:
    """``k`` for ``cuda:k`` (``cuda`` = 0), ``None`` for any other device (``cpu``, ...)."""
    kind, _, index = str(device).partition(":")
    return None if kind != "cuda" else int(index or 0)


def spare_gpu_ids(visible_ids: Sequence[str], trainer_devices: Sequence[Any]) -> list[str]:
    """The visible GPU ids no training rank uses (trainer ``cuda:k`` holds ``visible_ids[k]``)."""
    indices = [k for k in map(cuda_index, trainer_devices) if k is not None]
    if any(not 0 <= k < len(visible_ids) for k in indices):
        raise ValueError(
            f"training devices {[f'cuda:{k}' for k in indices]} are not all among the {len(visible_ids)} visible "
            f"GPU(s) {list(visible_ids)} (CUDA_VISIBLE_DEVICES renumbers them from 0)"
        )
    taken = {visible_ids[k] for k in indices}
    return [gpu for gpu in visible_ids if gpu not in taken]


def local_ray_gpus(
    trainer_devices: Sequence[Any], asked_gpus: float, cuda_visible_devices: str | None, device_count: int = 0
) -> list[str]:
    """The GPU ids to start this node's Ray with: the spare ones, failing when the workers of this node
    ask for more (``asked_gpus``: local workers x ``num_gpus_per_worker``)."""
    visible = visible_gpu_ids(cuda_visible_devices, device_count)
    spare = spare_gpu_ids(visible, trainer_devices)
    if asked_gpus > len(spare) + _EPS:
        raise ValueError(
            f"the rollout workers ask for {asked_gpus:g} GPU(s) but only {len(spare)} of the {len(visible)} "
            f"visible are free of the training ranks on this node (free: {spare}): lower num_workers, "
            f"num_gpus_per_worker or trainer.devices, or run the workers elsewhere (RAY_ADDRESS)"
        )
    return spare


@contextmanager
def only_gpus(ids: Sequence[str]) -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES=ids`` while the block runs (start the local Ray in it: its raylet keeps
    it), restored after; a CUDA context the caller already has is not affected."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    try:
        yield
    finally:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        os.environ.update({} if before is None else {"CUDA_VISIBLE_DEVICES": before})


def worker_device(trainer_device: Any) -> str:
    """The device a worker actor uses for a trainer on ``trainer_device``: ``cuda:0`` for any
    ``cuda:k`` (an actor sees only its own GPUs, numbered from 0), else the device type (``cpu``)."""
    return "cuda:0" if cuda_index(trainer_device) is not None else str(trainer_device).partition(":")[0]


def worker_bundles(
    num_cpus: float,
    num_gpus: float,
    resources: dict[str, float] | None = None,
    layout: WorkerLayout = "actor",
) -> tuple[list[dict[str, float]], str]:
    """The bundles of one worker's placement group and its strategy (pure)."""
    first = {"CPU": float(num_cpus), **{k: float(v) for k, v in (resources or {}).items()}}
    if layout == "actor":
        bundles = [{**first, "GPU": float(num_gpus)}]
    elif layout == "per_gpu":
        if num_gpus < 1 or not float(num_gpus).is_integer():
            raise ValueError(f"layout='per_gpu' needs a whole num_gpus_per_worker >= 1, got {num_gpus:g}")
        bundles = [{**first, "GPU": 1.0}] + [{"GPU": 1.0} for _ in range(int(num_gpus) - 1)]
    else:
        raise ValueError(f"layout must be 'actor' or 'per_gpu', got {layout!r}")
    bundles = [{k: v for k, v in b.items() if v > 0} for b in bundles]
    if not bundles[0]:
        raise ValueError("a worker that asks for no CPU, GPU or resource needs no placement group")
    return bundles, "STRICT_PACK"


def wanted_resources(num_workers: int, bundles: list[dict[str, float]]) -> dict[str, float]:
    """What ``num_workers`` placement groups of ``bundles`` take in all (pure)."""
    return {
        k: num_workers * sum(b.get(k, 0.0) for b in bundles)
        for k in dict.fromkeys(k for b in bundles for k in b)
    }


def missing_resources(wanted: dict[str, float], free: dict[str, float]) -> dict[str, tuple[float, float]]:
    """``{key: (wanted, free)}`` for every key of which less is free than wanted (pure)."""
    return {k: (v, free.get(k, 0.0)) for k, v in wanted.items() if v > free.get(k, 0.0) + _EPS}


def _free(keys: Sequence[str]) -> dict[str, Any]:
    """Ray's free amounts of ``keys`` (CPU and GPU always), in all and per node."""
    import ray

    keys = list(dict.fromkeys(["CPU", "GPU", *keys]))
    free: dict[str, Any] = {k: ray.available_resources().get(k, 0.0) for k in keys}
    try:  # Ray has no public call for the free resources per node
        from ray._private.state import available_resources_per_node

        free["per_node"] = {
            n[:8]: {k: r.get(k, 0.0) for k in keys} for n, r in available_resources_per_node().items()
        }
    except Exception:  # noqa: BLE001 - the totals still say enough; never hide the error being raised
        pass
    return free


def check_free(num_workers: int, bundles: list[dict[str, float]], wait_s: float = 10.0) -> None:
    """Fail fast when Ray has less free (``ray.available_resources()``) than the workers take.

    Ray returns a killed actor's resources a moment after the kill, so a fit started right after
    another fit's workers stopped (a notebook's second ``fit``) may see them still held: when the
    cluster has enough in all, the check looks again for up to ``wait_s`` seconds before it fails.
    """
    import ray

    wanted = wanted_resources(num_workers, bundles)
    deadline = time.monotonic() + wait_s
    missing = missing_resources(wanted, ray.available_resources())
    could_free = not missing_resources(wanted, ray.cluster_resources())
    while missing and could_free and time.monotonic() < deadline:
        time.sleep(0.25)
        missing = missing_resources(wanted, ray.available_resources())
    if missing:
        asked = ", ".join(f"{k}={w:g} (free {f:g})" for k, (w, f) in missing.items())
        raise PlacementError(
            f"{num_workers} rollout worker(s) need {asked}; each asks for bundles {bundles}; Ray has "
            f"{_free(list(wanted))} free: other actors or placement groups hold the rest, or lower "
            f"num_workers or the per-worker resources"
        )


@dataclass
class WorkerPlacement:
    """Workers' placement groups and actor options: ``ray.remote(cls).options(**p.options[i])``."""

    groups: list[Any]
    options: list[dict[str, Any]]
    bundles: list[dict[str, float]] = field(default_factory=list)

    def remove(self) -> None:
        """Remove the placement groups (their actors die with them); idempotent."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for group in self.groups if ray.is_initialized() else []:  # a Ray call would start a fresh Ray
            with suppress(Exception):  # already removed, or Ray gone
                remove_placement_group(group)
        self.groups = []


def place_workers(
    num_workers: int,
    num_cpus_per_worker: float = 1,
    num_gpus_per_worker: float = 0,
    resources: dict[str, float] | None = None,
    layout: WorkerLayout = "actor",
    timeout_s: float = 60.0,
) -> WorkerPlacement:
    """One placement group per worker, all ready within ``timeout_s``, else none and a
    :class:`PlacementError`. ``resources`` are the worker's extra resources (a custom label such
    as ``{"rollout_node": 1}``, or ``{"node:10.0.0.5": 0.01}``) and go into its first bundle."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundles, strategy = worker_bundles(num_cpus_per_worker, num_gpus_per_worker, resources, layout)
    check_free(num_workers, bundles)
    groups = [placement_group(bundles, strategy=strategy) for _ in range(num_workers)]
    placement = WorkerPlacement(groups, [], bundles)
    refs = [group.ready() for group in groups]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if len(ready) < len(refs):
        done = set(ready)
        late = [i for i, ref in enumerate(refs) if ref not in done]
        placement.remove()
        raise PlacementError(
            f"{len(late)} of {num_workers} rollout worker placement group(s) (workers {late}) were not "
            f"ready within timeout_s={timeout_s:g}: each asks for bundles {bundles} ({strategy}: all on one "
            f"node); Ray has {_free(list(wanted_resources(1, bundles)))} free. A node with that much free is "
            f"missing: free resources held by others, or lower num_workers or the per-worker resources"
        )
    gpus = 0.0 if layout == "per_gpu" else float(num_gpus_per_worker)
    extra, capture = dict(resources or {}), layout == "per_gpu"
    placement.options = [
        dict(num_cpus=num_cpus_per_worker, num_gpus=gpus, resources=extra, scheduling_strategy=pgs)
        for pgs in (PlacementGroupSchedulingStrategy(g, 0, capture) for g in groups)
    ]
    return placement


def actor_placement_info() -> dict[str, Any]:
    """Where the calling actor (or task) runs: node, its Ray GPU ids and ``CUDA_VISIBLE_DEVICES``."""
    import ray

    ctx = ray.get_runtime_context()
    group = ray.util.get_current_placement_group()
    return {
        "node_id": ctx.get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
        "gpu_ids": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "placement_group": group.id.hex() if group is not None else None,
    }


class PlacementProbe:
    """A tiny actor that reports where it runs: ``ray.remote(PlacementProbe).options(**opts)``."""

    def info(self) -> dict[str, Any]:
        return actor_placement_info()


def _probe() -> dict[str, Any]:
    return actor_placement_info()


def __getattr__(name: str) -> Any:
    """``probe_task``: :func:`actor_placement_info` as a Ray task (``probe_task.options(**worker_options)
    .remote()``), made on first use so that importing this module does not import ``ray``."""
    if name != "probe_task":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import ray

    task = ray.remote(num_cpus=0)(_probe)
    globals()["probe_task"] = task
    return task


def local_node_ip() -> str:
    """This node's IP address as Ray sees it (the address the workers report) when Ray is imported,
    else the host name's address (an in-process engine's run has no Ray)."""
    ray = sys.modules.get("ray")
    if ray is not None:
        return ray.util.get_node_ip_address()
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def trainer_placement_info(rank: int, device: Any, visible_ids: Sequence[str], node_ip: str = "") -> dict:
    """A training rank's entry of the report (``visible_ids``: :func:`visible_gpu_ids` of its node)."""
    k, ip = cuda_index(device), node_ip or local_node_ip()
    return {
        "rank": rank,
        "node_ip": ip,
        "device": str(device),
        "gpu_ids": [] if k is None else [visible_ids[k]],
    }


def find_overlaps(
    trainers: list[dict], workers: list[dict], reward_workers: Sequence[dict] = ()
) -> list[str]:
    """Every GPU a rollout or reward worker shares with a training rank on the same machine (pure)."""
    held = {(t["node_ip"], g): t["rank"] for t in trainers for g in t.get("gpu_ids", [])}
    rows = [("rollout worker", w["worker"], w) for w in workers]
    rows += [("reward worker", w["reward_worker"], w) for w in reward_workers]
    return [
        f"{role} {index} shares GPU {g} on {w['node_ip']} with training rank {held[w['node_ip'], g]}"
        for role, index, w in rows
        for g in w.get("gpu_ids", [])
        if (w["node_ip"], g) in held
    ]


def placement_report(
    trainers: list[dict], workers: list[dict], folder: str | None = None, reward_workers: Sequence[dict] = ()
) -> str:
    """A table of where the training ranks and the workers run (``workers``: dicts of
    :func:`actor_placement_info` plus ``worker``, the index, and optionally ``rank``, the training
    rank it serves; ``reward_workers``: the same with ``reward_worker``, the index); writes
    ``placement.json`` into ``folder`` when given (``reward_workers`` only when there are some).
    Overlaps are listed."""
    overlaps = find_overlaps(trainers, workers, reward_workers)
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
        record: dict[str, Any] = {"trainers": trainers, "workers": workers}
        if reward_workers:
            record["reward_workers"] = list(reward_workers)
        with open(os.path.join(folder, "placement.json"), "w") as f:
            json.dump({**record, "overlaps": overlaps}, f, indent=2)
    rows = [("role", "index", "node ip", "node", "GPU ids", "device | CUDA_VISIBLE_DEVICES")]
    rows += [
        ("trainer", f"rank {t['rank']}", t["node_ip"], "", ",".join(t["gpu_ids"]), t["device"])
        for t in trainers
    ]
    rows += [
        ("worker", f"{w['worker']}" + (f" (rank {w['rank']})" if "rank" in w else ""), w["node_ip"],
         (w.get("node_id") or "")[:8], ",".join(w.get("gpu_ids", [])),
         f"{w['device']} (in the trainer's process)" if w.get("in_process") else str(w.get("cuda_visible_devices")))
        for w in workers
    ]  # fmt: skip
    rows += [
        ("reward", f"{w['reward_worker']}" + (f" (rank {w['rank']})" if "rank" in w else ""), w["node_ip"],
         (w.get("node_id") or "")[:8], ",".join(w.get("gpu_ids", [])), str(w.get("cuda_visible_devices")))
        for w in reward_workers
    ]  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(n) for c, n in zip(r, widths)).rstrip() for r in rows]
    lines += [f"OVERLAP: {o}" for o in overlaps] or ["no GPU is shared between training ranks and workers"]
    return "\n".join(lines)
