"""vLLM's ``AsyncLLM`` behind the continuous engine (``VLLMEngineConfig(batching="continuous")``; real
CPU vLLM, its engine core in a process of its own): calls join the running batch, a push pauses the
scheduler in ``keep`` mode and the requests continue in place with each token stamped by vLLM with the
version that sampled it; a fit keeps the on-policy pin at ``max_staleness=0`` and the bound with
``sync_mode="continue"``."""

from __future__ import annotations

import threading
import time

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm runs these in .venv-vllm)")

from tests.builders import fit_tiny, tiny_module  # noqa: E402
from tests.vllm.helpers import max_logprob_gap, records, tiny_policy  # noqa: E402
from unirl_lightning.engines.vllm import VLLMEngineConfig  # noqa: E402
from unirl_lightning.rollout.records import RolloutRequest, SamplingParams  # noqa: E402
from unirl_lightning.strategy import AsyncRolloutStrategy  # noqa: E402

pytestmark = pytest.mark.slow


def request(gen_id: int, max_new_tokens: int, n: int = 4, seed: int = 1) -> RolloutRequest:
    return RolloutRequest(
        gen_id=gen_id,
        records=records(),
        n=n,
        sampling=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0),
        seed=seed,
    )


@pytest.fixture(scope="module")
def engine():
    built = VLLMEngineConfig(batching="continuous").build(tiny_policy())
    yield built
    built.close()


def test_the_engine_core_runs_in_a_process_of_its_own_and_calls_share_it(engine):
    assert not engine.in_process  # pushes go to vLLM's engine-core process packed
    out: dict[int, list] = {}
    calls = [
        threading.Thread(target=lambda i=i: out.setdefault(i, engine.generate(request(i, 8, seed=i))))
        for i in range(3)
    ]
    for call in calls:
        call.start()
    for call in calls:
        call.join()
    assert sorted(out) == [0, 1, 2]
    for groups in out.values():
        assert [len(g) for g in groups] == [4] * len(records())
        assert all(r.weight_version == 0 and r.token_versions is None for g in groups for r in g)
    model, _ = tiny_policy().build()
    gap = max_logprob_gap(model, [g for groups in out.values() for g in groups], 1.0)
    print(f"continuous vLLM: 3 concurrent calls, log-prob gap to the trainer's recompute {gap:.2e}")
    assert gap < 1e-4
    occupancy = engine.occupancy()
    assert (
        occupancy["slots"] > 0 and 0 < occupancy["row_seconds"] <= occupancy["slots"] * occupancy["seconds"]
    )
    # a seeded call samples the same tokens alone as beside others (per-request seeds)
    again = engine.generate(request(1, 8, seed=1))
    assert [r.completion_ids for g in again for r in g] == [r.completion_ids for g in out[1] for r in g]


def test_a_push_mid_generation_continues_the_requests_in_place_each_token_keeping_its_version(engine):
    """The push pauses vLLM's scheduler (``keep``), loads, and resumes: requests in flight hold tokens
    of both versions, in order; a call after the push is wholly the new version, and its log-probs are
    the new weights' (the load reached the engine-core process)."""
    before = engine.weight_version
    new_model, _ = tiny_policy(seed=5).build()  # built before the requests start: they last ~0.1 s here
    weights = list(new_model.state_dict().items())
    out: dict[str, list] = {}
    call = threading.Thread(target=lambda: out.setdefault("groups", engine.generate(request(10, 58, seed=3))))
    call.start()
    deadline = time.monotonic() + 30
    while engine.rows.live < 16 and time.monotonic() < deadline:  # every request added
        time.sleep(0.005)
    time.sleep(0.02)  # a few tokens each
    engine.load_weights(weights, before + 1)
    call.join()
    rows = [r for g in out["groups"] for r in g]
    spanning = [r for r in rows if r.token_versions is not None]
    print(
        f"continuous vLLM push mid-generation: {len(spanning)} of {len(rows)} samples span versions "
        f"{before} -> {before + 1}; first switch at token "
        f"{min((r.token_versions.index(before + 1) for r in spanning), default=None)}"
    )
    assert spanning, "no request was in flight at the push: it drained instead of continuing"
    for r in spanning:
        assert r.token_versions == sorted(r.token_versions)
        assert set(r.token_versions) == {before, before + 1}
        assert len(r.token_versions) == len(r.completion_ids)
        assert r.weight_version == before  # a group is stamped with its oldest token
    after = engine.generate(request(11, 8, seed=4))
    assert all(r.weight_version == before + 1 and r.token_versions is None for g in after for r in g)
    assert max_logprob_gap(new_model, after, 1.0) < 1e-4


def test_a_prefix_cached_before_a_push_never_serves_a_request_added_after_it():
    """A prompt of two full KV blocks is cached under the old weights; a push lands while requests run,
    so vLLM cannot reset its prefix cache; the same prompt after the push is computed by the new weights
    alone (its log-probs are the new model's). Without the requests' version-named ``cache_salt`` its
    prefix blocks come from the cache, computed by the old weights, and the gap is far above 1e-4."""
    from unirl_lightning.models.causal_lm import TinyCausalLM

    def policy(seed: int) -> TinyCausalLM:  # long enough for two of vLLM-CPU's 128-token blocks
        sizes = dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
        return TinyCausalLM(**sizes, max_position_embeddings=512, seed=seed)

    engine = VLLMEngineConfig(batching="continuous").build(policy(0))
    try:
        block = engine.engine.vllm_config.cache_config.block_size
        prompt = "1+2=" * ((2 * block + 3) // 4 + 1)  # the char tokenizer: one token per character
        assert len(prompt) + 60 <= 512, f"block size {block} is too large for this test"
        sampling = SamplingParams(max_new_tokens=4, temperature=1.0)
        long = RolloutRequest(records=[{"prompt": prompt}], n=1, sampling=sampling, seed=2)
        old_model, _ = policy(0).build()
        assert max_logprob_gap(old_model, engine.generate(long), 1.0) < 1e-4  # cached under these weights
        new_model, _ = policy(9).build()  # built before the requests start: they last ~0.1 s here
        weights = list(new_model.state_dict().items())
        out: dict[str, list] = {}
        busy = RolloutRequest(
            records=records(), n=4, sampling=SamplingParams(max_new_tokens=58, temperature=1.0), seed=5
        )
        call = threading.Thread(target=lambda: out.setdefault("groups", engine.generate(busy)))
        call.start()
        deadline = time.monotonic() + 30
        while engine.rows.live < 16 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.02)
        engine.load_weights(weights, 1)  # rows live: vLLM keeps its cache
        call.join()
        assert any(r.token_versions is not None for g in out["groups"] for r in g), "no row was live"
        gap = max_logprob_gap(new_model, engine.generate(long), 1.0)
        print(
            f"continuous vLLM: block size {block}, prompt {len(prompt)} tokens, gap after the push {gap:.2e}"
        )
        assert gap < 1e-4
    finally:
        engine.close()


def test_an_adapter_push_while_requests_run_is_refused(engine):
    engine.rows.add(+1)  # a request in flight (the count the engine keeps)
    try:
        with pytest.raises(RuntimeError, match="use sync_mode='quiesce' with LoRA"):
            engine._load_lora([], engine.weight_version + 1)
    finally:
        engine.rows.add(-1)


def streaming_fit(
    tmp_path,
    max_steps: int,
    max_staleness: int,
    max_new_tokens: int,
    slots: int | None = None,
    lr: float = 3e-3,
):
    engine = {"engine_kwargs": {"max_num_seqs": slots}} if slots else {}
    strategy = AsyncRolloutStrategy(
        engine=VLLMEngineConfig(batching="continuous", **engine),
        max_staleness=max_staleness,
        max_inflight=max(1, max_staleness + 1),
        launch_unit="group",
        sync_mode="continue",
    )
    try:
        _, _, recorder = fit_tiny(
            tmp_path, max_steps=max_steps, strategy=strategy,
            module=tiny_module(policy=tiny_policy(), max_new_tokens=max_new_tokens, lr=lr),
        )  # fmt: skip
    finally:
        strategy.shutdown()
    assert len(recorder.steps) == max_steps
    return recorder


@pytest.mark.usefixtures("ray_local")
def test_streaming_on_vllm_stays_exactly_on_policy_at_max_staleness_0(tmp_path):
    recorder = streaming_fit(tmp_path, 4, 0, 12)
    ratios = [step["metrics"]["train/ratio_mean"] for step in recorder.steps]
    gaps = [step["metrics"]["train/logp_diff_abs"] for step in recorder.steps]
    print(
        f"continuous vLLM, groups, continue: ratio_mean in [{min(ratios):.6f}, {max(ratios):.6f}], gap <= {max(gaps):.2e}"
    )
    for step in recorder.steps:
        assert set(step["row_versions"]) == {step["version"]}
        assert abs(step["metrics"]["train/ratio_mean"] - 1.0) < 1e-3
        assert step["metrics"]["train/logp_diff_abs"] < 1e-4


@pytest.mark.usefixtures("ray_local")
def test_streaming_on_vllm_pushes_in_flight_with_token_versions_within_the_bound(tmp_path):
    recorder = streaming_fit(tmp_path, 6, 1, 40)
    metrics = [step["metrics"] for step in recorder.steps]
    spanning = sum(m.get("rollout/interrupted_samples", 0.0) for m in metrics)
    occupancy = [m["rollout/engine_occupancy"] for m in metrics if "rollout/engine_occupancy" in m]
    print(f"continuous vLLM, continue: {spanning:.0f} samples spanned a push; occupancy {occupancy}")
    for step in recorder.steps:
        assert all(0 <= step["version"] - v <= 1 for v in step["row_versions"]), step
    assert max(m.get("rollout/token_versions_max_spread", 0.0) for m in metrics) <= 1
    assert occupancy and all(0 < o <= 1 for o in occupancy)


@pytest.mark.usefixtures("ray_local")
def test_streaming_keeps_a_vllm_engine_full_on_a_long_tail_at_the_streaming_recipes_staleness(tmp_path):
    """The long-tail case on vLLM-CPU: the untrained policy held fixed (lr 0), so its lengths stay
    geometric up to the 48-token cap; 8 slots (``max_num_seqs``) against 16 rows a step. At
    ``max_staleness: 2`` (the streaming recipe's) the window keeps rows queued, so the engine stays full
    (``rollout/engine_occupancy``: vLLM's slots holding a submitted row, a bound from above on its running
    count); at 0 (sync) every step's tail empties it; 1 is printed beside them."""
    occupancy = {}
    for staleness in (0, 1, 2):
        recorder = streaming_fit(tmp_path / str(staleness), 8, staleness, 48, slots=8, lr=0.0)
        # the first step fills the pipeline; a step trained wholly on groups reaped before it carries no
        # engine report, so no occupancy window (its time counts in the next step that reaps one)
        metrics = [
            step["metrics"] for step in recorder.steps[1:] if "rollout/engine_occupancy" in step["metrics"]
        ]
        assert len(metrics) >= 3, [sorted(step["metrics"]) for step in recorder.steps]
        occupancy[staleness] = sum(m["rollout/engine_occupancy"] for m in metrics) / len(metrics)
        starved = sum(m["rollout/engine_starved"] for m in metrics) / len(metrics)
        lengths = [round(m["rollout/completion_len"], 1) for m in metrics]
        print(
            f"vLLM-CPU, 8 slots, staleness {staleness}: occupancy {occupancy[staleness]:.3f}, starved {starved:.3f}, lengths {lengths}"
        )
        assert (
            abs(occupancy[staleness] + starved - 1.0) < 1e-6
        )  # vLLM's counter: a free slot is a starved one
    assert occupancy[2] >= 0.85
    assert occupancy[2] > occupancy[0] + 0.1
