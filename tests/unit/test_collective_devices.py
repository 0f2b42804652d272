"""Every tensor built for a collective names its device (NCCL reduces CUDA tensors only; gloo, which CI
runs, accepts CPU tensors, so a forgotten device is invisible at run time here).

A static check over the package: in every function that calls a collective (``reduce``,
``all_reduce``, ``broadcast``, ``all_gather``, ...), each tensor built from host data
(``torch.tensor``, ``torch.empty``, ``torch.zeros``, ...) passes ``device=``. Tensors a collective gets
from the model (parameters, gradients, DTensor shards) live on the training device already.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from unirl_lightning.weight_sync.collective import receive_device

PACKAGE = Path(__file__).resolve().parents[2] / "unirl_lightning"
COLLECTIVES = {
    "reduce",
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "send",
    "recv",
}
FACTORIES = {"tensor", "as_tensor", "empty", "zeros", "ones", "full", "arange", "rand", "randn"}


def _calls(node: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _attr(call: ast.Call) -> str | None:
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def tensors_without_device(source: str, filename: str = "<source>") -> list[str]:
    """``file:line`` of every host-built tensor without ``device=`` in a function that calls a collective."""
    found = []
    for function in ast.walk(ast.parse(source, filename)):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        calls = _calls(function)
        if not any(_attr(call) in COLLECTIVES for call in calls):
            continue
        for call in calls:
            func = call.func
            is_factory = (
                isinstance(func, ast.Attribute)
                and func.attr in FACTORIES
                and isinstance(func.value, ast.Name)
                and func.value.id == "torch"
            )
            if is_factory and not any(keyword.arg == "device" for keyword in call.keywords):
                found.append(f"{filename}:{call.lineno}")
    return found


def test_every_tensor_built_for_a_collective_in_the_package_names_its_device():
    offending = []
    for path in sorted(PACKAGE.rglob("*.py")):
        offending += tensors_without_device(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert offending == [], f"tensors handed to a collective without a device: {offending}"


def test_the_check_finds_a_host_tensor_handed_to_a_reduction():
    bad = (
        "def log(self, values):\n"
        "    t = torch.tensor(values, dtype=torch.float64)\n"
        "    return self.trainer.strategy.reduce(t)\n"
    )
    good = bad.replace("dtype=torch.float64)", "dtype=torch.float64, device=self.device)")
    assert tensors_without_device(bad) == ["<source>:2"]
    assert tensors_without_device(good) == []


def test_collective_receive_buffers_live_on_the_workers_own_device():
    """Inside a Ray actor the GPUs Ray assigned are its only visible ones: NCCL buffers go on cuda:0,
    whatever ordinal the trainer's rank uses; gloo broadcasts host tensors."""
    assert receive_device("nccl") == torch.device("cuda", 0)
    assert receive_device("gloo") == torch.device("cpu")


def test_the_push_deadline_is_the_process_groups_unless_given():
    """One setting: a collective sync without its own ``timeout_s`` waits as long as the training
    process group (the worker's receive and the rank's broadcast alike); 120 s with one rank."""
    from unirl_lightning.strategy import (
        AsyncRolloutDDPStrategy,
        AsyncRolloutFSDPStrategy,
        AsyncRolloutStrategy,
    )
    from unirl_lightning.weight_sync.collective import SINGLE_RANK_TIMEOUT_S, CollectiveWeightSync

    assert CollectiveWeightSync().timeout_s == SINGLE_RANK_TIMEOUT_S == 120.0
    followed, given = CollectiveWeightSync(), CollectiveWeightSync(timeout_s=50)
    followed.follow_process_group(900)
    given.follow_process_group(900)
    assert (followed.timeout_s, given.timeout_s) == (900.0, 50.0)
    assert AsyncRolloutDDPStrategy(timeout_s=900, weight_sync="collective").process_group_timeout_s == 900.0
    assert (
        AsyncRolloutFSDPStrategy(weight_sync="collective", max_worker_restarts=0).process_group_timeout_s
        == 1800.0
    )
    assert AsyncRolloutStrategy(weight_sync="collective").process_group_timeout_s is None
