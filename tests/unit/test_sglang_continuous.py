"""The continuous SGLang engine's own logic against a stand-in for ``sglang`` (SGLang has no CPU build).

The stand-in keeps the hazards of SGLang 0.5.23's source that the engine is built around: the Engine
binds to the loop running when it is created and its synchronous methods call
``loop.run_until_complete`` on it; the tokenizer manager's coroutines must run on that loop; a tensor
update outside a weight-update session fails; a cache flush with a running batch fails; an in-place
pause freezes requests until ``continue_generation``; and a finished request reports its tokens'
weight versions as spans, recorded at each version change from the tokens each live request had."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import types
from types import SimpleNamespace

import pytest
import torch

from unirl_lightning.core.preflight import continue_engine_error
from unirl_lightning.engines.sglang import SGLangEngine, SGLangEngineConfig, weight_update_session
from unirl_lightning.rollout.records import RolloutRequest, SamplingParams


class Manager:
    """SGLang's tokenizer manager, reduced to what the engine calls."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.bound = loop
        self.version = "default"
        self.paused = False
        self.resumed = asyncio.Event()
        self.live: dict[int, list[int]] = {}  # request -> its tokens so far
        self.events: dict[int, list[tuple[str, int]]] = {}  # request -> (old version, tokens then)
        self.session = False
        self.calls: list[str] = []
        self.context_len = 64
        self.salts: list[str | None] = []  # each request's prefix-cache namespace, in arrival order

    def on_loop(self, what: str) -> None:
        assert asyncio.get_running_loop() is self.bound, f"{what} ran on a loop SGLang is not bound to"
        self.calls.append(what)

    async def pause_generation(self, obj):
        self.on_loop(f"pause:{obj.mode}")
        self.paused = True
        self.resumed.clear()

    async def continue_generation(self, obj):
        self.on_loop("continue")
        self.paused = False
        self.resumed.set()

    async def update_weight_version(self, obj):
        self.on_loop(f"version:{obj.new_version}")
        assert obj.abort_all_requests is False, "the version update would abort every request"
        for rid, tokens in self.live.items():
            if tokens:
                self.events[rid].append((self.version, len(tokens)))
        self.version = obj.new_version

    async def tensor_update(self, names: list[str], flush_cache: bool):
        self.on_loop("tensors+flush" if flush_cache else "tensors")
        if not self.session:
            return (
                False,
                "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()",
            )
        if flush_cache and self.live:
            return False, "Weights were updated, but the cache was not flushed"
        return True, "Success"

    async def set_session(self, open_: bool):
        self.on_loop("begin" if open_ else "end")
        self.session = open_
        return True, ""


class Engine:
    """``sglang.Engine``: created on a running loop, synchronous methods through ``self.loop``."""

    created: list[Engine] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.loop = asyncio.get_running_loop()  # SGLang's _ensure_event_loop: the running loop first
        self.tokenizer_manager = Manager(self.loop)
        self.next_rid = 0
        Engine.created.append(self)

    def get_server_info(self):  # the launch argument unset; the scheduler's own cap in its state
        return {
            "max_running_requests": None,
            "internal_states": [{"effective_max_running_requests_per_dp": 8}],
        }

    def begin_weight_update(self):
        return self.loop.run_until_complete(self.tokenizer_manager.set_session(True))

    def end_weight_update(self):
        return self.loop.run_until_complete(self.tokenizer_manager.set_session(False))

    def update_weights_from_tensor(self, named_tensors, flush_cache=True):
        names = [name for name, _ in named_tensors]
        return self.loop.run_until_complete(self.tokenizer_manager.tensor_update(names, flush_cache))

    def shutdown(self):
        self.tokenizer_manager.calls.append("shutdown")

    async def async_generate(
        self, input_ids, sampling_params, return_logprob, lora_path=None, cache_salt=None
    ):
        manager = self.tokenizer_manager
        manager.on_loop("generate")
        manager.salts.append(cache_salt)
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        tokens = manager.live[rid] = []
        manager.events[rid] = []
        while len(tokens) < sampling_params["max_new_tokens"]:
            await asyncio.sleep(0.002)
            while manager.paused:
                await manager.resumed.wait()
            tokens.append(3 + len(tokens))
        del manager.live[rid]
        spans, start = [], 0  # SGLang's compute_weight_version_spans
        for version, end in [*manager.events.pop(rid), (manager.version, len(tokens))]:
            if end > start:
                spans.append({"version": version, "start": start, "end": end})
                start = end
        return {
            "meta_info": {
                "output_token_logprobs": [(-0.25, t, None) for t in tokens],
                "finish_reason": {"type": "length"},
                "weight_versions": spans,
            }
        }


def io_struct() -> types.ModuleType:
    module = types.ModuleType("sglang.srt.managers.io_struct")
    module.PauseGenerationReqInput = lambda mode="abort": SimpleNamespace(mode=mode)
    module.ContinueGenerationReqInput = lambda: SimpleNamespace()
    module.UpdateWeightVersionReqInput = lambda new_version, abort_all_requests=True: SimpleNamespace(
        new_version=new_version, abort_all_requests=abort_all_requests
    )
    return module


@pytest.fixture
def engine(monkeypatch):
    """An AsyncSGLangEngine on the stand-in, its model files skipped (the policy is a stand-in too)."""
    package = types.ModuleType("sglang")
    package.Engine = Engine
    for name in ("sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang", package)
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io_struct())
    from unirl_lightning.engines.sglang_async import AsyncSGLangEngine

    made = object.__new__(AsyncSGLangEngine)
    made.config = SGLangEngineConfig(batching="continuous", bucket_mb=1e-4)
    made.lora, made.weight_version, made._asleep = None, 0, False
    made._lora_name, made._lora_count, made._cleanup = None, 0, lambda: None
    made.policy = SimpleNamespace(
        prompt_ids=lambda tok, record: [int(record["prompt"])], stop_ids=lambda tok: [0]
    )
    made.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    made.engine = made._start({"model_path": "stand-in"})
    yield made
    made.close()


def request(max_new_tokens: int, prompts=("11", "22"), n: int = 2) -> RolloutRequest:
    sampling = SamplingParams(max_new_tokens=max_new_tokens)
    return RolloutRequest([{"prompt": p} for p in prompts], n=n, sampling=sampling, seed=1)


def test_the_engine_binds_to_its_loop_thread_and_runs_without_the_overlap_scheduler(engine):
    sglang_engine = engine.engine
    assert sglang_engine.kwargs == {"model_path": "stand-in", "disable_overlap_schedule": True}
    assert sglang_engine.tokenizer_manager.bound is engine.loop.loop
    assert sglang_engine.tokenizer_manager.calls == ["version:0"]  # every token stamped from the start
    assert engine.rows.slots == 8  # SGLang's max_running_requests
    groups = engine.generate(request(3))
    assert [[r.completion_ids for r in g] for g in groups] == [[[3, 4, 5]] * 2] * 2
    assert [r.logprobs for g in groups for r in g] == [[-0.25] * 3] * 4
    assert all(r.token_versions is None and g[0].weight_version == 0 for g in groups for r in g)


def test_calls_from_two_threads_are_in_the_engine_at_once(engine):
    seen = []
    results = {}

    def call(name):
        results[name] = engine.generate(request(40, prompts=("1",), n=1))

    threads = [threading.Thread(target=call, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(seen) < 1:
        if engine.rows.live == 2:
            seen.append(2)
        time.sleep(0.001)
    for thread in threads:
        thread.join()
    assert seen == [2] and set(results) == {"a", "b"}
    assert engine.rows.live == 0 and engine.occupancy()["row_seconds"] > 0


def test_a_push_mid_generation_pauses_in_place_and_every_token_keeps_its_version(engine):
    manager = engine.engine.tokenizer_manager
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("groups", engine.generate(request(60))))
    worker.start()
    while not manager.live or min(len(t) for t in manager.live.values()) < 5:
        time.sleep(0.001)
    weights = [("model.layers.0.w", torch.zeros(64)), ("model.layers.1.w", torch.zeros(64))]
    engine.load_weights(weights, 1)
    worker.join()
    pushed = manager.calls[manager.calls.index("pause:in_place") :]
    assert pushed[:6] == ["pause:in_place", "begin", "tensors", "tensors", "end", "version:1"]
    assert pushed[6] == "continue"  # generation went on after the version was set, not before
    assert engine.weight_version == 1
    rows = [r for g in out["groups"] for r in g]
    assert all(r.token_versions is not None for r in rows)
    for row in rows:
        switch = row.token_versions.index(1)
        assert switch >= 5 and row.token_versions == [0] * switch + [1] * (60 - switch)
    assert all(g[0].weight_version == 0 for g in out["groups"])  # a group is as old as its oldest token
    assert manager.salts == ["w0"] * 4  # added under version 0: they share cached prefixes among themselves
    engine.generate(request(2))
    assert (
        manager.salts[4:] == ["w1"] * 4
    )  # added after the push: no prefix the old weights cached serves them


def test_a_push_into_an_idle_engine_flushes_the_cache_and_a_failed_bucket_closes_the_session(engine):
    manager = engine.engine.tokenizer_manager
    engine.load_weights([("w", torch.zeros(4))], 3)
    assert manager.calls[-6:] == ["pause:in_place", "begin", "tensors+flush", "end", "version:3", "continue"]
    assert not manager.session and engine.weight_version == 3

    def refused(named_tensors, flush_cache=True):
        return False, "bad tensor"

    engine.engine.update_weights_from_tensor = refused
    with pytest.raises(RuntimeError, match=r"update_weights_from_tensor \(bucket 1/1\) failed: bad tensor"):
        engine.load_weights([("w", torch.zeros(4))], 4)
    assert not manager.session and not manager.paused and engine.weight_version == 3


def test_a_lora_push_while_requests_run_is_refused_naming_the_way_out(engine):
    engine.rows.add(+2)
    with pytest.raises(
        RuntimeError, match=r"LoRA adapter push \(weight_version 2\).*2 request\(s\).*quiesce"
    ):
        engine._load_lora([("lora_A", torch.zeros(2))], 2)


def test_the_static_engine_loads_inside_a_weight_update_session():
    calls = []
    sglang_engine = SimpleNamespace(
        begin_weight_update=lambda: calls.append("begin") or (True, ""),
        end_weight_update=lambda: calls.append("end") or (True, ""),
        update_weights_from_tensor=lambda named_tensors, flush_cache: (
            calls.append(("load", flush_cache)) or (True, "")
        ),
    )
    static = object.__new__(SGLangEngine)
    static.engine, static.config = sglang_engine, SGLangEngineConfig(bucket_mb=1e-4)
    static._load_full([("model.layers.0.w", torch.zeros(64)), ("model.layers.1.w", torch.zeros(64))])
    assert calls == ["begin", ("load", False), ("load", True), "end"]
    with weight_update_session(SimpleNamespace()):  # a version without sessions: nothing to open
        pass


def test_continuous_batching_is_a_choice_and_names_the_allowed_values():
    assert SGLangEngineConfig(batching="continuous").loads_in_flight
    assert SGLangEngineConfig(batching="continuous", concurrent_calls=5).max_concurrency == 5
    assert SGLangEngineConfig().max_concurrency == 1 and not SGLangEngineConfig().loads_in_flight
    with pytest.raises(ValueError, match=r"batching.*static.*continuous.*'rolling'"):
        SGLangEngineConfig(batching="rolling")
    assert continue_engine_error("continue", SGLangEngineConfig(batching="continuous")) is None
    assert "SGLangEngineConfig" in continue_engine_error("continue", SGLangEngineConfig())
