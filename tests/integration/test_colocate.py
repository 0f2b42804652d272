"""A synchronous colocated tiny fit on real Ray workers, with a recording stand-in for the engine's
sleep/wake (CPU: HF's sleep is a no-op and vLLM-CPU has no sleep mode): the order of the engine's and
the trainer's calls at every step."""

from __future__ import annotations

import pytest
import torch

from tests.builders import fit_tiny
from tests.recording_engine import RecordingHFEngineConfig, read_events, record_event
from unirl_lightning.runtime import base as runtime_base
from unirl_lightning.strategy import AsyncRolloutStrategy

pytestmark = pytest.mark.usefixtures("ray_local")


def record_trainer_calls(monkeypatch, path):
    """Record the trainer's side of the colocated sync (the offload functions the runtime calls), and
    any ``torch.cuda.empty_cache``, into the engines' event file."""
    for name, event in (
        ("free_trainer_memory", "free_cache"),
        ("optimizers_to_host", "optimizer_to_host"),
        ("optimizers_to_device", "optimizer_to_device"),
    ):
        original = getattr(runtime_base, name)

        def recording(*args, _original=original, _event=event):
            record_event(path, _event)
            return _original(*args)

        monkeypatch.setattr(runtime_base, name, recording)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: record_event(path, "empty_cache"))


class TrainRecorder:
    def __init__(self, path):
        self.path = path

    def __call__(self, module_training_step):
        def training_step(*args, **kwargs):
            record_event(self.path, "train")
            return module_training_step(*args, **kwargs)

        return training_step


@pytest.mark.parametrize("offload_optimizer", [True, False])
def test_colocated_step_order_frees_the_trainer_then_wakes_in_two_phases(
    tmp_path, monkeypatch, offload_optimizer
):
    from tests.builders import tiny_module

    path = str(tmp_path / "events.txt")
    record_trainer_calls(monkeypatch, path)
    module = tiny_module()
    module.training_step = TrainRecorder(path)(module.training_step)
    strategy = AsyncRolloutStrategy(
        engine=RecordingHFEngineConfig(device="cpu", num_threads=1, events_path=path),
        max_staleness=0,
        max_inflight=1,
        placement="colocate",
        offload_optimizer=offload_optimizer,
    )
    try:
        _, _, recorder = fit_tiny(tmp_path, max_steps=3, strategy=strategy, module=module)
    finally:
        strategy.shutdown()
    events = read_events(path)
    assert events[:2] == ["build(enable_sleep_mode=True)", "push"]  # colocate turns sleep mode on; start
    steps = events[events.index("generate") :]  # (Lightning empties the CUDA cache itself at start)
    back, away = (["optimizer_to_device"], ["optimizer_to_host"]) if offload_optimizer else ([], [])
    step = [
        "generate",
        "sleep",
        *back,
        "train",
        *away,
        "free_cache",
        "wake(weights)",
        "push",
        "wake(kv_cache)",
    ]
    assert steps == step * 3  # CPU training: free_cache does not call torch.cuda.empty_cache
    for row in recorder.steps:
        assert abs(row["metrics"]["train/ratio_mean"] - 1.0) < 1e-3  # on-policy
