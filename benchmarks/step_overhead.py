"""Where a tiny GRPO step's time goes beyond generate and train (issue 15 #2, issue 11 #3).

    python benchmarks/step_overhead.py [--quick] [--steps 50] [--warmup 5]

Runs, each in its own process, on the *tiny* workload of issue 15 (``add_mod10``, 8 prompts x 8
samples x 3 new tokens, random-init Llama hidden 128, 2 layers, MLP 256, lr 3e-4; one Ray rollout
worker with 1 torch thread, trainer 1 thread):

* ``sync-full``: ``max_staleness=0, max_inflight=1`` set up the way ``examples/grpo_tiny.yaml`` runs:
  TensorBoard logger with ``log_every_n_steps=1``, the default callbacks (``WeightSyncCallback``,
  ``WeightVersionLogger`` with its histogram every 10 steps, ``CheckpointOnExit``), the progress
  bar, ``RolloutEvalCallback(every_n_steps=20, num_prompts=20)``;
* ``sync-bare``: the same without logger, progress bar and eval (how ``vs_trl.py`` and
  ``time_to_accuracy.py`` run ours);
* ``async-full``: ``sync-full`` with ``max_staleness=1, max_inflight=2``;
* ``vs_trl-sync``: ``sync-bare`` on issue 11's workload (below);
* ``sync-cprofile``: ``sync-full`` under ``cProfile`` (the top functions by own time);
* ``train-profile``: the train step under ``torch.profiler`` on issue 11's workload
  (``digit_successor`` with an 8-digit prefix, 16 x 8 x 16 tokens, hidden 128, 4 layers, EOS
  suppressed), then counterfactual variants of the same step in plain torch on the last batch
  (no entropy pass, logits only at completion positions, no second grad norm, fused AdamW) to
  price what each change would save, and the library's ``ExperienceBatch.collate`` against a
  vectorised one on the same groups;
* ``push-variants``: the weight push alone (``ObjectStoreWeightSync.push``), the ``ensure_alive``
  ping that precedes it, a bare Ray actor call, and a push of one flat buffer, round-robin.

Timers: the library's functions and Lightning's hooks are wrapped in the child process (monkey
patching, no library change) with an exclusive-time stack, so every millisecond of a step is
attributed to exactly one component; what no wrapper covers is Lightning's loop itself ("lightning
loop (rest)"). The worker reports its own generate and score time; the driver's time launching,
polling and waiting beyond that is the Ray round trip. Step time is measured from the end of one
step (``on_train_batch_end``) to the end of the next, over ``--steps`` steps after ``--warmup``.
"Fixed overhead" = step time - generation on the step's path (sync: the worker's generate and
score; async: the waits for generation, including the quiesce before each push) - train compute
(forward, loss, backward, clip, optimizer step, zero_grad, advantages). Target (issue 15): <= 15 ms.
Both the means (which add up to the step) and the medians over steps (robust to the stalls of a
shared machine) are reported.

Prints a breakdown table (ms per step per component) and a final JSON line; writes
``benchmarks/results/step_overhead.json``; ``python benchmarks/plot.py`` draws
``benchmarks/results/step_overhead.png``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "token")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

RESULTS_PATH = common.RESULTS / "step_overhead.json"
TARGET_MS = 15.0
WORKLOADS = {
    "tiny": {
        "layers": 2,
        "task": "add_mod10",
        "task_kwargs": {},
        "prompts": 8,
        "group": 8,
        "max_new_tokens": 3,
        "lr": 3e-4,
        "suppress_eos": False,
        "max_positions": 64,
    },
    "vs_trl": {
        "layers": 4,
        "task": "digit_successor",
        "task_kwargs": {"prefix_len": 8},
        "prompts": 16,
        "group": 8,
        "max_new_tokens": 16,
        "lr": 1e-6,
        "suppress_eos": True,
        "max_positions": 128,
    },
}
RUNS: dict[str, dict[str, Any]] = {
    "sync-full": {"workload": "tiny", "mode": "sync", "full": True, "profile": "timers"},
    "sync-bare": {"workload": "tiny", "mode": "sync", "full": False, "profile": "timers"},
    "async-full": {"workload": "tiny", "mode": "async", "full": True, "profile": "timers"},
    "sync-cprofile": {"workload": "tiny", "mode": "sync", "full": True, "profile": "cprofile"},
    "vs_trl-sync": {"workload": "vs_trl", "mode": "sync", "full": False, "profile": "timers"},
    "train-profile": {"workload": "vs_trl", "mode": "sync", "full": False, "profile": "torch"},
    "push-variants": {"workload": "tiny", "mode": "sync", "full": False, "profile": "push"},
}

# timer key -> component of the breakdown
COMPONENTS = {
    "rollout.launch": "ray round trip",
    "rollout.poll": "ray round trip",
    "rollout.wait": "ray round trip",
    "rollout.next_batch": "rollout loop bookkeeping",
    "rollout.drain": "rollout loop bookkeeping",
    "rollout.make_batch": "collate + rollout stats",
    "rollout.collate": "collate + rollout stats",
    "batch.to_device": "batch to device",
    "train.step": "training_step python (own)",
    "train.update": "training_step python (own)",
    "train.optimizers": "training_step python (own)",
    "train.prepare": "train: advantages",
    "train.forward": "train: forward + log-probs + entropy",
    "train.policy_loss": "train: loss + metrics",
    "train.loss": "train: loss + metrics",
    "train.backward": "train: backward",
    "train.grad_norm_log": "train: extra grad norm (logged)",
    "train.clip": "train: clip_gradients",
    "train.optimizer_step": "train: optimizer step",
    "train.zero_grad": "train: zero_grad",
    "log.self_log": "logging: self.log / log_dict",
    "log.self_log_dict": "logging: self.log / log_dict",
    "log.connector": "logging: Lightning logger connector",
    "log.tensorboard": "logging: TensorBoard write",
    "log.histogram": "logging: staleness histogram",
    "log.save": "logging: logger save",
    "sync.weights": "weight push: bookkeeping",
    "sync.quiesce": "wait for generation: quiesce before the push",
    "sync.ping": "weight push: ping workers (ensure_alive)",
    "sync.push": "weight push: copy to CPU",
    "sync.named_weights": "weight push: copy to CPU",
    "sync.ray_put": "weight push: ray.put",
    "sync.ray_get": "weight push: workers load (ray.get)",
}
TRAIN_COMPUTE = (
    "train: advantages",
    "train: forward + log-probs + entropy",
    "train: loss + metrics",
    "train: backward",
    "train: clip_gradients",
    "train: optimizer step",
    "train: zero_grad",
)


# -- the exclusive-time timers ---------------------------------------------------------------------
class Timers:
    """A stack of wrapped calls: each call's own time (minus the wrapped calls inside it) is added to
    its key, so the keys partition the time covered by the outermost wrapped calls."""

    def __init__(self, record_function: bool = False) -> None:
        self.stack: list[list[float]] = []
        self.own: dict[str, float] = defaultdict(float)
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.extra: dict[str, float] = defaultdict(float)
        self.record_function = record_function

    def reset(self) -> None:
        self.own.clear()
        self.total.clear()
        self.calls.clear()
        self.extra.clear()

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

        wrapper.__wrapped_by_timers__ = True
        return wrapper

    def patch(self, owner: Any, attr: str, key: str) -> None:
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
    """Wrap the library's and Lightning's per-step functions (class level, before anything is built)."""
    import torch
    from lightning.pytorch.core.module import LightningModule
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector

    import unirl_lightning.modules.base as base_mod
    import unirl_lightning.modules.causal_lm as causal_mod
    import unirl_lightning.weight_sync.object_store as store_mod
    from unirl_lightning.rollout.batches import ExperienceBatch
    from unirl_lightning.rollout.controller import BatchRolloutController
    from unirl_lightning.rollout.loop import RolloutLoop
    from unirl_lightning.strategy import AsyncRolloutStrategy
    from unirl_lightning.workers import RolloutWorkerGroup

    p = timers.patch
    p(RolloutLoop, "next_batch", "rollout.next_batch")
    p(RolloutLoop, "_make_batch", "rollout.make_batch")
    p(BatchRolloutController, "launch_until", "rollout.launch")
    p(RolloutLoop, "_reap", "rollout.poll")
    p(BatchRolloutController, "wait_oldest", "rollout.wait")
    p(BatchRolloutController, "drain_freshest", "rollout.drain")
    p(ExperienceBatch, "collate", "rollout.collate")
    p(ExperienceBatch, "to", "batch.to_device")
    p(base_mod.PolicyGradientModule, "training_step", "train.step")
    p(base_mod.PolicyGradientModule, "update", "train.update")
    p(causal_mod.CausalLMModule, "prepare_batch", "train.prepare")
    p(causal_mod.CausalLMModule, "sequence_logprobs", "train.forward")
    p(causal_mod.CausalLMModule, "policy_loss", "train.policy_loss")
    p(causal_mod, "ppo_clip_loss", "train.loss")
    p(LightningModule, "manual_backward", "train.backward")
    p(LightningModule, "clip_gradients", "train.clip")
    p(LightningModule, "optimizers", "train.optimizers")
    p(LightningModule, "log", "log.self_log")
    p(LightningModule, "log_dict", "log.self_log_dict")
    p(torch.nn.utils, "get_total_norm", "train.grad_norm_log")
    p(LightningOptimizer, "step", "train.optimizer_step")
    p(torch.optim.Optimizer, "zero_grad", "train.zero_grad")
    p(_LoggerConnector, "update_train_step_metrics", "log.connector")
    p(_LoggerConnector, "on_batch_start", "log.connector")
    p(_LoggerConnector, "on_batch_end", "log.connector")
    p(TensorBoardLogger, "log_metrics", "log.tensorboard")
    p(_TrainingEpochLoop, "_save_loggers_on_train_batch_end", "log.save")
    p(AsyncRolloutStrategy, "sync_weights", "sync.weights")
    p(BatchRolloutController, "quiesce", "sync.quiesce")
    p(RolloutWorkerGroup, "ensure_alive", "sync.ping")
    p(store_mod.ObjectStoreWeightSync, "push", "sync.push")
    p(store_mod, "named_weights", "sync.named_weights")

    class RayProxy:
        """``ray`` as the object-store push sees it, with ``put`` / ``get`` timed."""

        def __init__(self, ray: Any) -> None:
            self._ray = ray
            self.put = timers.timed("sync.ray_put", ray.put)
            self.get = timers.timed("sync.ray_get", ray.get)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._ray, name)

    store_mod.ray = RayProxy(store_mod.ray)

    complete = RolloutLoop.complete

    def counting_complete(self: Any, gen_id: int, weight_version: int, result: dict) -> Any:
        timers.extra["worker.generate"] += result["generate_s"]
        timers.extra["worker.score"] += result["score_s"]
        timers.extra["worker.results"] += 1
        return complete(self, gen_id, weight_version, result)

    RolloutLoop.complete = counting_complete


def wrap_callbacks(timers: Timers, trainer: Any, skip: Any) -> None:
    """Time every callback's per-step hooks that it overrides (own time, under ``callback.<Class>``)."""
    from lightning.pytorch.callbacks import Callback

    hooks = (
        "on_train_batch_start",
        "on_train_batch_end",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_before_zero_grad",
    )
    for cb in trainer.callbacks:
        if cb is skip:
            continue
        for hook in hooks:
            if getattr(type(cb), hook) is getattr(Callback, hook):
                continue
            setattr(cb, hook, timers.timed(f"callback.{type(cb).__name__}", getattr(cb, hook)))


# -- one run (child process) -----------------------------------------------------------------------
def _load_flat(worker: Any, flat: Any, spec: list[tuple[str, list[int]]], version: int) -> int:
    """In the worker: split one flat buffer back into named tensors and load them."""
    import torch

    flat = torch.as_tensor(flat)
    named, offset = {}, 0
    for name, shape in spec:
        numel = 1
        for d in shape:
            numel *= d
        named[name] = flat[offset : offset + numel].view(shape)
        offset += numel
    worker.engine.load_weights(named.items(), version)
    return version


def child_push(cfg: dict[str, Any]) -> None:
    """The weight push and a bare Ray call, timed alone (round-robin), and two cheaper pushes."""
    import warnings

    import ray
    import torch

    from unirl_lightning.engines.hf import HFEngineConfig
    from unirl_lightning.models import PretrainedCausalLM
    from unirl_lightning.weight_sync import ObjectStoreWeightSync
    from unirl_lightning.weight_sync.base import named_weights
    from unirl_lightning.workers import RolloutWorkerGroup, shutdown_ray_if_owned

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    spec = PretrainedCausalLM(name_or_path=cfg["model_dir"], dtype="float32")
    model, _ = spec.build()
    workers = RolloutWorkerGroup(HFEngineConfig(device="cpu", num_threads=1), spec, reward=None)
    worker = workers.workers[0]
    sync = ObjectStoreWeightSync()
    version = [0]

    def library_push() -> None:
        version[0] += 1
        sync.push(model, workers, version[0])

    def flat_push(as_numpy: bool) -> None:
        version[0] += 1
        tensors = named_weights(model)
        flat = torch.cat([t.reshape(-1) for t in tensors.values()])
        layout = [(k, list(t.shape)) for k, t in tensors.items()]
        ref = ray.put(flat.numpy() if as_numpy else flat)
        ray.get(worker.run.remote(_load_flat, ref, layout, version[0]))

    variants = {
        "library push (ObjectStoreWeightSync)": library_push,
        "ensure_alive ping (before every push)": lambda: workers.ensure_alive(30.0),
        "bare actor call (round trip)": lambda: ray.get(worker.weight_version.remote()),
        "one flat tensor, worker.run unflattens": lambda: flat_push(False),
        "one flat numpy buffer (zero-copy get)": lambda: flat_push(True),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(cfg["reps"]):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    tensors = named_weights(model)
    # the pushed weights really arrive: the worker's state equals the trainer's
    state = ray.get(worker.state_dict.remote())
    same = all(torch.equal(state[k], v) for k, v in tensors.items())
    workers.shutdown()
    shutdown_ray_if_owned()
    common.emit(
        {
            "name": cfg["name"],
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "tensors": len(tensors),
            "weights_arrived": same,
            "ms": {name: 1e3 * statistics.median(v[1:]) for name, v in times.items()},
            "reps": cfg["reps"],
        }
    )


def child(cfg: dict[str, Any]) -> None:
    common.quiet()
    if cfg["profile"] == "push":
        child_push(cfg)
        return
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything
    from lightning.pytorch.loggers import TensorBoardLogger

    from unirl_lightning import AsyncRolloutStrategy, GRPOModule, PromptDataModule
    from unirl_lightning.callbacks import RolloutEvalCallback
    from unirl_lightning.engines.hf import HFEngineConfig
    from unirl_lightning.models import PretrainedCausalLM

    wl = WORKLOADS[cfg["workload"]]
    captured: dict[str, Any] = {}
    if cfg["profile"] == "torch":  # keep the last collated groups for the collate counterfactual
        from unirl_lightning.rollout.batches import ExperienceBatch

        collate = ExperienceBatch.__dict__["collate"].__func__

        def capturing_collate(cls: Any, groups: list, pad_token_id: int) -> Any:
            captured["groups"], captured["pad"] = groups, pad_token_id
            return collate(cls, groups, pad_token_id)

        capturing_collate.__wrapped__ = collate
        ExperienceBatch.collate = classmethod(capturing_collate)
    timers = Timers(record_function=cfg["profile"] == "torch")
    if cfg["profile"] in ("timers", "torch"):
        instrument(timers)
    warmup, steps = cfg["warmup"], cfg["steps"]

    class Probe(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.padding: list[float] = []
            self.untrained_positions: list[float] = []
            self.profiler: Any = None
            self.last_batch: Any = None
            self.frozen: dict[str, dict[str, float]] = {}  # the timers at the end of the window
            self.per_step: list[dict[str, Any]] = []
            self.prev: dict[str, float] = {}
            self.prev_extra: dict[str, float] = {}

        def setup(self, trainer, pl_module, stage):  # noqa: ANN001, ANN201
            if cfg["profile"] == "timers":
                wrap_callbacks(timers, trainer, self)
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    writer = logger.experiment
                    writer.add_histogram = timers.timed("log.histogram", writer.add_histogram)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001, ANN201
            numel = batch.attention_mask.numel()
            self.padding.append(1.0 - float(batch.attention_mask.sum()) / numel)
            positions = batch.response_mask[:, 1:]
            self.untrained_positions.append(1.0 - float(positions.sum()) / positions.numel())
            self.last_batch = batch

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001, ANN201
            self.stamps.append(time.perf_counter())
            if batch_idx == warmup - 1:
                timers.reset()
                if cfg["profile"] == "cprofile":
                    import cProfile

                    self.profiler = cProfile.Profile()
                    self.profiler.enable()
                elif cfg["profile"] == "torch":
                    self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                    self.profiler.__enter__()
            if warmup <= batch_idx < warmup + steps:  # this step's share of every timer (ms)
                own = {k: 1e3 * (v - self.prev.get(k, 0.0)) for k, v in timers.own.items()}
                extra = {k: 1e3 * (v - self.prev_extra.get(k, 0.0)) for k, v in timers.extra.items()}
                self.per_step.append(
                    {"step_ms": 1e3 * (self.stamps[-1] - self.stamps[-2]), "own": own, "extra": extra}
                )
                self.prev, self.prev_extra = dict(timers.own), dict(timers.extra)
            if batch_idx == warmup + steps - 1:
                self.frozen = {
                    "own": dict(timers.own),
                    "total": dict(timers.total),
                    "calls": dict(timers.calls),
                    "extra": dict(timers.extra),
                }
            if batch_idx == warmup + steps - 1 and self.profiler is not None:
                if cfg["profile"] == "cprofile":
                    self.profiler.disable()
                else:
                    self.profiler.__exit__(None, None, None)

    seed_everything(0)
    strategy = AsyncRolloutStrategy(
        engine=HFEngineConfig(device="cpu", num_threads=1),
        max_staleness=0 if cfg["mode"] == "sync" else 1,
        max_inflight=1 if cfg["mode"] == "sync" else 2,
        num_workers=1,
        trainer_threads=1,
        seed=0,
    )
    module = GRPOModule(
        policy=PretrainedCausalLM(name_or_path=cfg["model_dir"], dtype="float32"),
        reward=common.FirstCharReward(),
        num_generations=wl["group"],
        max_new_tokens=wl["max_new_tokens"],
        lr=wl["lr"],
    )
    probe = Probe()
    callbacks: list[Any] = [probe]
    with tempfile.TemporaryDirectory(prefix="overhead-") as logdir:
        if cfg["full"]:
            callbacks.append(RolloutEvalCallback(every_n_steps=20, num_prompts=20))
        trainer = Trainer(
            strategy=strategy,
            max_steps=warmup + steps,
            callbacks=callbacks,
            logger=TensorBoardLogger(logdir, name="run") if cfg["full"] else False,
            log_every_n_steps=1,
            enable_checkpointing=False,
            enable_progress_bar=cfg["full"],
            enable_model_summary=False,
            limit_val_batches=0,
        )
        data = PromptDataModule(
            train=wl["task"], batch_size=wl["prompts"], task_kwargs=wl["task_kwargs"] or None, seed=0
        )
        try:
            trainer.fit(module, datamodule=data)
        finally:
            strategy.shutdown()

    stamps = probe.stamps
    window_s = stamps[warmup + steps - 1] - stamps[warmup - 1]
    step_ms = 1e3 * window_s / steps
    result: dict[str, Any] = {
        "name": cfg["name"],
        "workload": cfg["workload"],
        "mode": cfg["mode"],
        "full": cfg["full"],
        "steps": steps,
        "step_ms": step_ms,
        "step_ms_median": 1e3
        * statistics.median(b - a for a, b in zip(stamps[warmup - 1 :], stamps[warmup:])),
        "padding_fraction": statistics.fmean(probe.padding),
        "untrained_logit_positions": statistics.fmean(probe.untrained_positions),
        "torch_threads": torch.get_num_threads(),
    }
    if cfg["profile"] in ("timers", "torch"):
        frozen = probe.frozen
        result["own_ms"] = {k: 1e3 * v / steps for k, v in frozen["own"].items()}
        result["total_ms"] = {k: 1e3 * v / steps for k, v in frozen["total"].items()}
        result["calls_per_step"] = {k: v / steps for k, v in frozen["calls"].items()}
        extra = frozen["extra"]
        result["worker_ms"] = {
            "generate": 1e3 * extra.get("worker.generate", 0.0) / steps,
            "score": 1e3 * extra.get("worker.score", 0.0) / steps,
            "results_per_step": extra.get("worker.results", 0.0) / steps,
        }
        result["per_step"] = [
            {
                "step_ms": p["step_ms"],
                "own_ms": p["own"],
                "worker_ms": {
                    "generate": p["extra"].get("worker.generate", 0.0),
                    "score": p["extra"].get("worker.score", 0.0),
                },
            }
            for p in probe.per_step
        ]
    if cfg["profile"] == "cprofile":
        result["cprofile"] = cprofile_table(probe.profiler, steps, cfg.get("prof_out"))
    if cfg["profile"] == "torch":
        result["torch_profile"] = torch_table(probe.profiler, steps)
        result["counterfactuals"] = counterfactuals(module, probe.last_batch, cfg["reps"])
        result["collate_ms"] = collate_counterfactual(captured["groups"], captured["pad"], cfg["reps"])
    common.emit(result)


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
    import pstats

    if out:
        profiler.dump_stats(out)
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():
        rows.append(
            {
                "function": f"{Path(filename).name}:{line}:{func}",
                "path": portable_path(filename),
                "calls_per_step": nc / steps,
                "own_ms_per_step": 1e3 * tt / steps,
                "cum_ms_per_step": 1e3 * ct / steps,
            }
        )
    rows.sort(key=lambda r: -r["own_ms_per_step"])
    return rows[:top]


def torch_table(profiler: Any, steps: int, top: int = 25) -> dict[str, Any]:
    events = profiler.key_averages()
    rows = []
    for e in events:
        rows.append(
            {
                "name": e.key,
                "calls_per_step": e.count / steps,
                "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                "cpu_ms_per_step": e.cpu_time_total / 1e3 / steps,
            }
        )
    labels = sorted(
        (
            r
            for r in rows
            if "." in r["name"] and r["name"].split(".")[0] in ("train", "rollout", "sync", "log", "batch")
        ),
        key=lambda r: -r["cpu_ms_per_step"],
    )
    ops = sorted((r for r in rows if r not in labels), key=lambda r: -r["self_cpu_ms_per_step"])
    return {"labels": labels, "top_ops": ops[:top]}


def counterfactuals(module: Any, batch: Any, reps: int) -> dict[str, Any]:
    """The train step's math in plain torch on ``batch``, with and without each candidate change
    (ms per step, median of ``reps``): what each library change would save on this workload."""
    import copy

    import torch

    from unirl_lightning.algorithms import entropy_from_logits, masked_mean, ppo_clip_loss, token_logprobs

    torch.set_num_threads(1)
    temperature = module.sampling.temperature
    prompt_len = int((batch.attention_mask.sum(1) - batch.response_mask.sum(1)).min())
    keep = batch.input_ids.shape[1] - prompt_len  # logits needed: the last prompt position onwards

    def step(policy: Any, opt: Any, entropy: bool, keep_only: bool, second_norm: bool) -> float:
        start = time.perf_counter()
        opt.zero_grad()
        mask = batch.response_mask[:, 1:]
        rollout_logp = batch.rollout_logprobs[:, 1:]
        if keep_only:
            logits = policy(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=keep + 1
            ).logits[:, :-1]
            targets = batch.input_ids[:, -keep:]
            mask, rollout_logp = mask[:, -keep:], rollout_logp[:, -keep:]
        else:
            logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
            targets = batch.input_ids[:, 1:]
        logp = token_logprobs(logits, targets, temperature)
        if entropy:
            with torch.no_grad():
                masked_mean(entropy_from_logits(logits, temperature), mask)
        adv = module.compute_advantages(batch.rewards, batch.group_size)
        loss, _ = ppo_clip_loss(logp, rollout_logp, adv, mask, 0.2, 0.2, "token-mean", max_tokens=16)
        loss.backward()
        params = [p for p in policy.parameters() if p.grad is not None]
        if second_norm:
            torch.nn.utils.get_total_norm([p.grad for p in params])
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return time.perf_counter() - start

    variants = {
        "as the library does it": dict(entropy=True, keep_only=False, second_norm=True, fused=False),
        "no entropy pass": dict(entropy=False, keep_only=False, second_norm=True, fused=False),
        "logits only at completion positions": dict(
            entropy=True, keep_only=True, second_norm=True, fused=False
        ),
        "grad norm once (reuse clip's)": dict(entropy=True, keep_only=False, second_norm=False, fused=False),
        "fused AdamW": dict(entropy=True, keep_only=False, second_norm=True, fused=True),
        "all four": dict(entropy=False, keep_only=True, second_norm=False, fused=True),
    }
    out: dict[str, Any] = {
        "keep_positions": keep,
        "rows": batch.num_rows,
        "width": int(batch.input_ids.shape[1]),
    }
    states = {}
    for name, v in variants.items():
        policy = copy.deepcopy(module.policy).train()
        states[name] = (policy, torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=v["fused"] or None))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):  # round-robin, so a slow phase of a shared machine hits every variant alike
        for name, v in variants.items():
            policy, opt = states[name]
            times[name].append(step(policy, opt, v["entropy"], v["keep_only"], v["second_norm"]))
    for name in variants:
        out[name] = 1e3 * statistics.median(times[name][1:])
    return out


def vectorized_collate(groups: list[list[Any]], pad_token_id: int) -> dict[str, Any]:
    """``ExperienceBatch.collate``'s tensors built from padded Python lists, one ``torch.tensor`` per field."""
    import torch

    rows = [r for g in groups for r in g]
    length = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    ids, attn, resp, logps = [], [], [], []
    for r in rows:
        p, c = len(r.prompt_ids), len(r.completion_ids)
        rest = length - p - c
        ids.append(r.prompt_ids + r.completion_ids + [pad_token_id] * rest)
        attn.append([1] * (p + c) + [0] * rest)
        resp.append([0.0] * p + [1.0] * c + [0.0] * rest)
        logps.append([0.0] * p + r.logprobs + [0.0] * rest)
    return {
        "input_ids": torch.tensor(ids, dtype=torch.long),
        "attention_mask": torch.tensor(attn, dtype=torch.long),
        "response_mask": torch.tensor(resp, dtype=torch.float32),
        "rollout_logprobs": torch.tensor(logps, dtype=torch.float32),
        "rewards": torch.tensor([r.reward for r in rows], dtype=torch.float32),
    }


def collate_counterfactual(groups: list[list[Any]], pad_token_id: int, reps: int) -> dict[str, Any]:
    """The library's collate vs :func:`vectorized_collate` on the same groups (ms, median), and a
    check that both give the same tensors."""
    import torch

    from unirl_lightning.rollout.batches import ExperienceBatch

    collate = ExperienceBatch.__dict__["collate"].__func__
    while hasattr(collate, "__wrapped__"):
        collate = collate.__wrapped__
    library = collate(ExperienceBatch, groups, pad_token_id)
    fast = vectorized_collate(groups, pad_token_id)
    same = all(torch.equal(getattr(library, k), v) for k, v in fast.items())
    times: dict[str, list[float]] = {"library": [], "vectorized": []}
    for _ in range(reps * 4):
        for name, fn in (
            ("library", lambda: collate(ExperienceBatch, groups, pad_token_id)),
            ("vectorized", lambda: vectorized_collate(groups, pad_token_id)),
        ):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {
        "rows": len([r for g in groups for r in g]),
        "same_tensors": same,
        **{k: 1e3 * statistics.median(v) for k, v in times.items()},
    }


# -- the driver ----------------------------------------------------------------------------------
def breakdown_median(run: dict[str, Any]) -> dict[str, float]:
    """The median over steps of each component (robust to the stalls of a shared machine; unlike the
    means, the medians need not add up to the median step)."""
    per_step = [breakdown({"mode": run["mode"], **p}) for p in run["per_step"]]
    keys = {k for b in per_step for k in b}
    med = {k: statistics.median(b.get(k, 0.0) for b in per_step) for k in keys}
    med["= step"] = statistics.median(p["step_ms"] for p in run["per_step"])
    med["fixed overhead"] = statistics.median(
        fixed_overhead({"mode": run["mode"], **p}, b) for p, b in zip(run["per_step"], per_step)
    )
    return dict(sorted(med.items(), key=lambda kv: -kv[1]))


def breakdown(run: dict[str, Any]) -> dict[str, float]:
    """ms per step per component (the components partition the step)."""
    comp: dict[str, float] = defaultdict(float)
    for key, ms in run["own_ms"].items():
        name = COMPONENTS.get(key)
        if name is None and key.startswith("callback."):
            name = f"callback {key.split('.', 1)[1]} (own)"
        comp[name or key] += ms
    gen, score = run["worker_ms"]["generate"], run["worker_ms"]["score"]
    comp["worker: generate"] = gen
    comp["worker: score"] = score
    if run["mode"] == "sync":  # the driver waited for the whole generation: the rest is Ray's
        comp["ray round trip"] -= gen + score
    else:
        comp["wait for generation (not hidden)"] = comp.pop("ray round trip")
        comp["worker: generate"] = 0.0  # overlapped with training: on the step's path only through the wait
        comp["worker: score"] = 0.0
        comp["(worker generate, overlapped)"] = gen
    covered = sum(v for k, v in comp.items() if not k.startswith("("))
    comp["lightning loop (rest)"] = run["step_ms"] - covered
    return dict(sorted(comp.items(), key=lambda kv: -kv[1]))


def fixed_overhead(run: dict[str, Any], comp: dict[str, float]) -> float:
    """Step - generation on the step's path (sync: the worker's generate + score; async: the waits
    for generation, the quiesce before the push included) - train compute."""
    compute = sum(comp.get(k, 0.0) for k in TRAIN_COMPUTE)
    if run["mode"] == "sync":
        return run["step_ms"] - comp["worker: generate"] - comp["worker: score"] - compute
    waits = sum(v for k, v in comp.items() if k.startswith("wait for generation"))
    return run["step_ms"] - waits - compute


def print_medians(runs: dict[str, dict[str, Any]]) -> None:
    timed = {n: r for n, r in runs.items() if "breakdown_median" in r}
    names = list(timed)
    keys: list[str] = []
    for r in timed.values():
        keys += [k for k in r["breakdown_median"] if k not in keys and r["breakdown_median"][k] >= 0.05]
    print("\nmedian over steps (robust to stalls), ms:")
    print(f"{'component':<42}" + "".join(f"{n:>14}" for n in names))
    for k in keys:
        print(f"{k:<42}" + "".join(f"{timed[n]['breakdown_median'].get(k, 0.0):>14.2f}" for n in names))


def print_breakdown(runs: dict[str, dict[str, Any]]) -> None:
    timed = {n: r for n, r in runs.items() if "breakdown" in r}
    names = list(timed)
    keys: list[str] = []
    for r in timed.values():
        keys += [k for k in r["breakdown"] if k not in keys]
    print(f"{'ms per step':<42}" + "".join(f"{n:>14}" for n in names))
    for k in keys:
        print(f"{k:<42}" + "".join(f"{timed[n]['breakdown'].get(k, 0.0):>14.2f}" for n in names))
    print(f"{'= step':<42}" + "".join(f"{timed[n]['step_ms']:>14.2f}" for n in names))
    print(
        f"{'fixed overhead (step - generate - compute)':<42}"
        + "".join(f"{timed[n]['fixed_overhead_ms']:>14.2f}" for n in names)
    )


def plot(results: dict[str, Any], path: Path) -> None:
    """Stacked bars: ms per step per component, for each timed run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {n: r for n, r in results["runs"].items() if "breakdown" in r}
    groups = {
        "worker generate + score": lambda k: k.startswith("worker:"),
        "wait for generation": lambda k: k.startswith("wait for generation"),
        "train compute": lambda k: k in TRAIN_COMPUTE,
        "ray round trip": lambda k: k == "ray round trip",
        "weight push": lambda k: k.startswith("weight push"),
        "logging": lambda k: k.startswith("logging") or "WeightVersionLogger" in k or "ProgressBar" in k,
        "eval": lambda k: "RolloutEvalCallback" in k,
        "collate + rollout loop": lambda k: (
            k.startswith("collate") or k.startswith("rollout loop") or k == "batch to device"
        ),
        "training_step python + extra norm": lambda k: (
            k.startswith("training_step") or "extra grad norm" in k
        ),
        "lightning loop + other callbacks": lambda k: True,
    }
    colors = [
        "#9aa5b1",
        "#c9ccd1",
        "#2f80ed",
        "#eb5757",
        "#f2994a",
        "#bb6bd9",
        "#56ccf2",
        "#6fcf97",
        "#f2c94c",
        "#333333",
    ]
    panels = [
        ("tiny: 8x8x3 tokens, h128 L2", {n: r for n, r in runs.items() if r["workload"] == "tiny"}),
        ("issue 11: 16x8x16, h128 L4", {n: r for n, r in runs.items() if r["workload"] != "tiny"}),
    ]
    panels = [(title, rs) for title, rs in panels if rs]
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(3 + 1.6 * len(runs), 4),
        squeeze=False,
        gridspec_kw={"width_ratios": [max(1, len(rs)) for _, rs in panels]},
    )
    for ax, (title, panel_runs) in zip(axes[0], panels):
        bottoms = [0.0] * len(panel_runs)
        for label, color in zip(groups, colors):
            values = []
            for r in panel_runs.values():
                total = 0.0
                for k, v in r["breakdown"].items():
                    if k.startswith("("):
                        continue
                    if next(g for g, f in groups.items() if f(k)) == label:
                        total += v
                values.append(total)
            ax.bar(list(panel_runs), values, bottom=bottoms, label=label, color=color)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        for i, r in enumerate(panel_runs.values()):
            ax.text(
                i,
                bottoms[i],
                f"{r['step_ms']:.0f} ms\nfixed {r['fixed_overhead_ms']:.0f}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(0, max(bottoms) * 1.25)
    axes[0][0].set_ylabel("ms per step (mean)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(
        f"Where a GRPO step's time goes (2 CPU cores; target fixed overhead <= {TARGET_MS:.0f} ms)",
        fontsize=9,
    )
    common.save_figure(fig, path)


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 warm-up + 8 steps")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--prof-out", default=None, help="also dump the cProfile stats here (pstats file)")
    parser.add_argument("--out", default=str(RESULTS_PATH))
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if args.quick:
        args.steps, args.warmup = 8, 3

    common.quiet()
    started = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="overhead-model-") as tmp:
        dirs = {}
        for name, wl in WORKLOADS.items():
            dirs[name] = str(Path(tmp) / name)
            common.build_model_dir(
                dirs[name],
                hidden=128,
                layers=wl["layers"],
                intermediate=256,
                max_positions=wl["max_positions"],
                seed=0,
                suppress_eos=wl["suppress_eos"],
            )
        for name in args.runs:
            spec = RUNS[name]
            steps = args.steps if spec["profile"] != "torch" else min(args.steps, 10)
            cfg = {
                "name": name,
                **spec,
                "model_dir": dirs[spec["workload"]],
                "steps": steps,
                "warmup": args.warmup,
                "prof_out": args.prof_out,
                "reps": 5 if args.quick else 15,
            }
            run = common.run_child(Path(__file__), cfg)
            if "own_ms" in run and spec["profile"] == "timers":
                run["breakdown"] = breakdown(run)
                run["fixed_overhead_ms"] = fixed_overhead(run, run["breakdown"])
                run["breakdown_median"] = breakdown_median(run)
                calls = run["calls_per_step"].get("log.self_log", 0.0)
                own = run["own_ms"].get("log.self_log", 0.0) + run["own_ms"].get("log.self_log_dict", 0.0)
                run["self_log_calls_per_step"] = calls
                run["self_log_ms_per_call"] = own / calls if calls else None
            runs[name] = run
            if "step_ms" in run:
                print(
                    f"  {name:<14} {run['step_ms']:.1f} ms/step (process {run['process_s']:.0f} s)",
                    flush=True,
                )
    print_breakdown(runs)
    print_medians(runs)
    for n, r in runs.items():
        if r.get("self_log_calls_per_step"):
            print(
                f"  {n}: {r['self_log_calls_per_step']:.0f} self.log calls per step, "
                f"{r['self_log_ms_per_call']:.3f} ms each"
            )
    if "sync-cprofile" in runs:
        print(
            "\ncProfile, sync-full, top functions by own time (ms per step; cProfile inflates Python-heavy code):"
        )
        for row in runs["sync-cprofile"]["cprofile"][:20]:
            print(
                f"  {row['own_ms_per_step']:>7.2f} own {row['cum_ms_per_step']:>8.2f} cum {row['calls_per_step']:>7.1f} calls  {row['function']}"
            )
    if "train-profile" in runs:
        tp = runs["train-profile"]
        print(f"\ntrain step, {tp['workload']} workload (torch.profiler, ms per step, CPU total by label):")
        for row in tp["torch_profile"]["labels"]:
            print(f"  {row['cpu_ms_per_step']:>8.2f}  {row['name']}")
        print("  top ops by self CPU:")
        for row in tp["torch_profile"]["top_ops"][:15]:
            print(
                f"  {row['self_cpu_ms_per_step']:>8.2f}  {row['calls_per_step']:>6.1f} calls  {row['name']}"
            )
        cm = tp["collate_ms"]
        print(
            f"  collate of {cm['rows']} rows: library {cm['library']:.2f} ms, vectorized {cm['vectorized']:.2f} ms "
            f"(same tensors: {cm['same_tensors']})"
        )
        print("  counterfactual train step (plain torch, same batch, ms):")
        for k, v in tp["counterfactuals"].items():
            print(f"  {k:<40} {v}")
    if "push-variants" in runs:
        pv = runs["push-variants"]
        print(
            f"\nweight push alone, tiny model ({pv['bytes'] / 1e6:.2f} MB in {pv['tensors']} tensors), ms (median):"
        )
        for k, v in pv["ms"].items():
            print(f"  {v:>8.2f}  {k}")
    config = vars(args) | {"out": None, "child": None, "workloads": WORKLOADS, "machine": common.machine()}
    config["wall_s"] = round(time.perf_counter() - started, 1)
    results = {"config": config, "runs": runs, "target_ms": TARGET_MS}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    if any("breakdown" in r for r in runs.values()):
        plot(results, Path(args.out).with_suffix(".png"))
    final: dict[str, Any] = {
        n: {
            "step_ms": round(r["step_ms"], 2),
            "fixed_overhead_ms": round(r["fixed_overhead_ms"], 2) if "fixed_overhead_ms" in r else None,
        }
        for n, r in runs.items()
        if "step_ms" in r
    }
    if "push-variants" in runs:
        final["push_ms"] = {k: round(v, 2) for k, v in runs["push-variants"]["ms"].items()}
    print(json.dumps({"quick": args.quick, "target_fixed_overhead_ms": TARGET_MS, **final}))


if __name__ == "__main__":
    main()
