"""The timers of ``step_overhead.py``'s child: an exclusive-time stack around public per-step functions,
and the cProfile / torch.profiler tables. A helper module (no ``main``).

Only public functions are wrapped: the library's (the rollout loop and controller, the batch, the
module's train step, the weight push), Lightning's public ``LightningModule`` / ``LightningOptimizer``
/ ``TensorBoardLogger`` methods, and torch's ``get_total_norm`` and ``Optimizer.zero_grad``; never
Lightning's private (``_``-prefixed) loop or connector classes. What no wrapper covers is Lightning's
loop itself ("lightning loop (rest)"). A target that no longer exists (the library moved it) is
listed under ``missing`` instead of failing the run.
"""

from __future__ import annotations

import functools
import importlib
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

# (module, owner in it ("" = the module itself), attribute, timer key); a key names its component in
# step_overhead_report.COMPONENTS
TARGETS = (
    ("unirl_lightning.rollout.loop", "RolloutLoop", "next_batch", "rollout.next_batch"),
    ("unirl_lightning.rollout.controller", "BatchRolloutController", "launch_until", "rollout.launch"),
    ("unirl_lightning.rollout.controller", "BatchRolloutController", "poll", "rollout.poll"),
    ("unirl_lightning.rollout.controller", "BatchRolloutController", "wait_oldest", "rollout.wait"),
    ("unirl_lightning.rollout.controller", "BatchRolloutController", "drain_freshest", "rollout.drain"),
    ("unirl_lightning.rollout.batches", "ExperienceBatch", "collate", "rollout.collate"),
    ("unirl_lightning.rollout.batches", "ExperienceBatch", "to", "batch.to_device"),
    ("unirl_lightning.modules.base", "PolicyGradientModule", "training_step", "train.step"),
    ("unirl_lightning.modules.base", "PolicyGradientModule", "update", "train.update"),
    ("unirl_lightning.modules.base", "PolicyGradientModule", "log_step_metrics", "log.step_metrics"),
    ("unirl_lightning.modules.grpo", "GRPOModule", "prepare_batch", "train.prepare"),
    ("unirl_lightning.modules.causal_lm", "CausalLMModule", "prepare_batch", "train.prepare"),
    ("unirl_lightning.modules.causal_lm", "CausalLMModule", "sequence_logprobs", "train.forward"),
    ("unirl_lightning.modules.causal_lm", "CausalLMModule", "policy_loss", "train.policy_loss"),
    ("unirl_lightning.modules.loss_settings", "PolicyLossSettings", "surrogate", "train.loss"),
    ("lightning.pytorch.core.module", "LightningModule", "manual_backward", "train.backward"),
    ("lightning.pytorch.core.module", "LightningModule", "clip_gradients", "train.clip"),
    ("lightning.pytorch.core.module", "LightningModule", "optimizers", "train.optimizers"),
    ("lightning.pytorch.core.module", "LightningModule", "log", "log.self_log"),
    ("lightning.pytorch.core.module", "LightningModule", "log_dict", "log.self_log_dict"),
    ("lightning.pytorch.core.optimizer", "LightningOptimizer", "step", "train.optimizer_step"),
    ("lightning.pytorch.loggers", "TensorBoardLogger", "log_metrics", "log.tensorboard"),
    ("torch.nn.utils", "", "get_total_norm", "train.grad_norm_log"),
    ("torch.optim", "Optimizer", "zero_grad", "train.zero_grad"),
    ("unirl_lightning.strategy", "AsyncRolloutStrategy", "sync_weights", "sync.weights"),
    ("unirl_lightning.rollout.controller", "BatchRolloutController", "quiesce", "sync.quiesce"),
    ("unirl_lightning.workers", "RolloutWorkerGroup", "ensure_alive", "sync.ping"),
    ("unirl_lightning.weight_sync.object_store", "ObjectStoreWeightSync", "push", "sync.push"),
)
CALLBACK_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
)


class Timers:
    """A stack of wrapped calls: each call's own time (minus the wrapped calls inside it) is added to
    its key, so the keys partition the time covered by the outermost wrapped calls."""

    def __init__(self, record_function: bool = False) -> None:
        self.stack: list[list[float]] = []
        self.own: dict[str, float] = defaultdict(float)
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.record_function = record_function
        self.missing: list[str] = []

    def reset(self) -> None:
        self.own.clear()
        self.total.clear()
        self.calls.clear()

    def timed(self, key: str, fn: Any) -> Any:
        timers = self

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            frame = [time.perf_counter(), 0.0]
            timers.stack.append(frame)
            try:
                if timers.record_function:
                    import torch

                    with torch.profiler.record_function(key):
                        return fn(*args, **kwargs)
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - frame[0]
                timers.stack.pop()
                timers.own[key] += elapsed - frame[1]
                timers.total[key] += elapsed
                timers.calls[key] += 1
                if timers.stack:
                    timers.stack[-1][1] += elapsed

        return wrapper

    def patch(self, owner: Any, attr: str, key: str) -> None:
        """Replace ``owner.attr`` (a function, method, classmethod or staticmethod) by its timed wrapper."""
        raw = (
            owner.__dict__[attr]
            if isinstance(owner, type) and attr in owner.__dict__
            else getattr(owner, attr)
        )
        if isinstance(raw, classmethod):
            setattr(owner, attr, classmethod(self.timed(key, raw.__func__)))
        elif isinstance(raw, staticmethod):
            setattr(owner, attr, staticmethod(self.timed(key, raw.__func__)))
        else:
            setattr(owner, attr, self.timed(key, raw))


def instrument(timers: Timers) -> None:
    """Wrap every :data:`TARGETS` function (class level, before anything is built); the ones that do
    not exist go to ``timers.missing``."""
    for module_name, owner_name, attr, key in TARGETS:
        where = f"{module_name}.{owner_name + '.' if owner_name else ''}{attr}"
        try:
            owner = importlib.import_module(module_name)
            if owner_name:
                owner = getattr(owner, owner_name)
            getattr(owner, attr)
        except (ImportError, AttributeError):
            timers.missing.append(where)
            continue
        timers.patch(owner, attr, key)


def wrap_callbacks(timers: Timers, trainer: Any, skip: Any) -> None:
    """Time every callback's per-step hooks that it overrides (own time, under ``callback.<Class>``)."""
    from lightning.pytorch.callbacks import Callback

    for cb in trainer.callbacks:
        if cb is skip:
            continue
        for hook in CALLBACK_HOOKS:
            if getattr(type(cb), hook) is not getattr(Callback, hook):
                setattr(cb, hook, timers.timed(f"callback.{type(cb).__name__}", getattr(cb, hook)))


def make_probe(timers: Timers, profile: str, warmup: int, steps: int) -> Any:
    """The callback that stamps every step's end, resets the timers after ``warmup`` steps, keeps each
    of the next ``steps`` steps' share of every timer (and the worker's generate and score time from
    the batch's ``perf/`` figures), and runs the ``profile`` (``cprofile`` / ``torch``) over them."""
    import torch
    from lightning.pytorch import Callback
    from lightning.pytorch.loggers import TensorBoardLogger

    class Probe(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.padding: list[float] = []
            self.untrained_positions: list[float] = []
            self.worker: tuple[float, float] = (0.0, 0.0)  # this step's generate, score (s)
            self.profiler: Any = None
            self.frozen: dict[str, dict[str, float]] = {}  # the timers at the end of the window
            self.per_step: list[dict[str, Any]] = []
            self.prev: dict[str, float] = {}

        def setup(self, trainer, pl_module, stage):  # noqa: ANN001, ANN201
            if profile == "timers":
                wrap_callbacks(timers, trainer, self)
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    writer = logger.experiment
                    writer.add_histogram = timers.timed("log.histogram", writer.add_histogram)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001, ANN201
            self.padding.append(1.0 - float(batch.attention_mask.sum()) / batch.attention_mask.numel())
            positions = batch.response_mask[:, 1:]
            self.untrained_positions.append(1.0 - float(positions.sum()) / positions.numel())
            stats = batch.stats
            self.worker = (float(stats["perf/generate_time_s"]), float(stats.get("perf/score_time_s", 0.0)))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001, ANN201
            self.stamps.append(time.perf_counter())
            if batch_idx == warmup - 1:
                timers.reset()
                if profile == "cprofile":
                    import cProfile

                    self.profiler = cProfile.Profile()
                    self.profiler.enable()
                elif profile == "torch":
                    self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                    self.profiler.__enter__()
            if warmup <= batch_idx < warmup + steps:  # this step's share of every timer (ms)
                own = {k: 1e3 * (v - self.prev.get(k, 0.0)) for k, v in timers.own.items()}
                worker_ms = {"generate": 1e3 * self.worker[0], "score": 1e3 * self.worker[1]}
                step_ms = 1e3 * (self.stamps[-1] - self.stamps[-2])
                self.per_step.append({"step_ms": step_ms, "own_ms": own, "worker_ms": worker_ms})
                self.prev = dict(timers.own)
            if batch_idx == warmup + steps - 1:
                self.frozen = {
                    "own": dict(timers.own),
                    "total": dict(timers.total),
                    "calls": dict(timers.calls),
                }
                if profile == "cprofile":
                    self.profiler.disable()
                elif profile == "torch":
                    self.profiler.__exit__(None, None, None)

    return Probe()


# -- profiler tables ---------------------------------------------------------------------------------
def portable_path(filename: str) -> str:
    """A profiled file's path without this machine's prefix: from the package on for installed and
    standard-library code (``ray/actor.py``, ``copy.py``), relative to the repository for ours."""
    installed = re.search(r"site-packages/(.+)", filename) or re.search(r"lib/python3\.\d+/(.+)", filename)
    if installed:
        return installed.group(1)
    try:
        return str(Path(filename).resolve().relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        return Path(filename).name


def cprofile_table(profiler: Any, steps: int, out: str | None, top: int = 30) -> list[dict[str, Any]]:
    """The ``top`` functions by own time, per step."""
    import pstats

    if out:
        profiler.dump_stats(out)
    rows = [
        {
            "function": f"{Path(filename).name}:{line}:{func}",
            "path": portable_path(filename),
            "calls_per_step": nc / steps,
            "own_ms_per_step": 1e3 * tt / steps,
            "cum_ms_per_step": 1e3 * ct / steps,
        }
        for (filename, line, func), (_cc, nc, tt, ct, _callers) in pstats.Stats(profiler).stats.items()
    ]
    rows.sort(key=lambda r: -r["own_ms_per_step"])
    return rows[:top]


def torch_table(profiler: Any, steps: int, top: int = 25) -> dict[str, Any]:
    """The timers' labels (CPU total) and the ``top`` torch ops by self CPU time, per step."""
    rows = [
        {
            "name": e.key,
            "calls_per_step": e.count / steps,
            "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
            "cpu_ms_per_step": e.cpu_time_total / 1e3 / steps,
        }
        for e in profiler.key_averages()
    ]
    prefixes = ("train", "rollout", "sync", "log", "batch")
    labels = sorted(
        (r for r in rows if "." in r["name"] and r["name"].split(".")[0] in prefixes),
        key=lambda r: -r["cpu_ms_per_step"],
    )
    ops = sorted((r for r in rows if r not in labels), key=lambda r: -r["self_cpu_ms_per_step"])
    return {"labels": labels, "top_ops": ops[:top]}
