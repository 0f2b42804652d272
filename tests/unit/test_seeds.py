"""Pins the seed derivation: every seed of a run is a hash of its path (rank, gen_id, worker part,
sample or chunk), so no two requests, parts or samples share a seed, the same settings give the same
seeds, and each engine's per-sample (or per-chunk) seeds come from it. No engine is installed or
built here: the engines' seed paths run against stand-ins for vLLM, SGLang and the diffusion model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from unirl_lightning.core.seeding import SEED_BITS, derive_seed, derive_seeds
from unirl_lightning.engines.diffusion import DiffusionEngine
from unirl_lightning.engines.sglang import SGLangEngine
from unirl_lightning.engines.vllm import VLLMEngine
from unirl_lightning.rollout.records import DiffusionSampling, RolloutRequest, SamplingParams
from unirl_lightning.runtime import RolloutSettings
from unirl_lightning.runtime.batch import BatchRuntime

RANKS, GEN_IDS, PARTS, RECORDS_PER_PART, N = 3, 200, 4, 2, 8  # 16 samples per part


def settings(seed: int | None, rank: int) -> RolloutSettings:
    return RolloutSettings(
        engine="auto",
        max_staleness=1,
        max_inflight=2,
        num_workers=PARTS,
        num_cpus_per_worker=1,
        num_gpus_per_worker=0,
        placement="separate",
        seed=seed,
        trainer_threads=None,
        generation_timeout_s=60.0,
        max_worker_restarts=0,
        rank=rank,
    )


def request_builder(seed: int, rank: int):
    """The batch runtime's own ``build_request`` for this rank (the loop it builds is never run)."""
    spec = SimpleNamespace(
        family="token",
        num_generations=N,
        sampling=SamplingParams(),
        collate=None,
        filter_groups=False,
        max_filter_launches_per_step=10,
    )
    return BatchRuntime(spec, settings(seed, rank), weight_sync=None).make_loop([], 1).build_request


def run_seeds(seed: int) -> dict[str, list[int]]:
    """Every seed the requests of a run use: request, worker part and per-sample seeds."""
    records = [{"prompt": f"p{i}"} for i in range(PARTS * RECORDS_PER_PART)]
    seeds: dict[str, list[int]] = {"request": [], "part": [], "sample": []}
    for rank in range(RANKS):
        build = request_builder(seed, rank)
        for gen_id in range(GEN_IDS):
            request = build(records, gen_id)
            seeds["request"].append(request.seed)
            parts = request.split(PARTS)
            assert len(parts) == PARTS
            for part in parts:
                seeds["part"].append(part.seed)
                seeds["sample"].extend(derive_seeds(part.seed, len(part.records) * part.n))
    return seeds


def test_derive_seed_is_a_stable_63_bit_hash_of_its_parts():
    assert derive_seed(3, 1, 7) == derive_seed(3, 1, 7)
    assert len({derive_seed(3, 1, 7), derive_seed(3, 7, 1), derive_seed(31, 7), derive_seed(3, 17)}) == 4
    assert derive_seed(0) != derive_seed(0, 0) != derive_seed()
    # pinned: the same settings give the same seeds in every process and on every machine
    assert derive_seed(0, 0, 0) == derive_seed(0, 0, 0) == 1276401239836843021
    for parts in [(0,), (-1, 2), (2**80, -(2**70)), (2**63 - 1, 0)]:
        assert 0 <= derive_seed(*parts) < 2**SEED_BITS <= 2**63


def test_a_runs_seeds_are_distinct_across_ranks_gen_ids_parts_and_samples():
    seeds = run_seeds(seed=0)
    samples = seeds["sample"]
    assert len(samples) == RANKS * GEN_IDS * PARTS * RECORDS_PER_PART * N == 38_400
    assert len(set(samples)) == len(samples), "two samples of the run share a seed"
    every = seeds["request"] + seeds["part"] + samples
    assert len(set(every)) == len(every), "a request, part and sample seed coincide"
    assert run_seeds(seed=0) == seeds, "the same settings must give the same seeds"
    other = run_seeds(seed=1)
    assert not set(other["sample"]) & set(samples), "runs with different seeds share sample seeds"


def test_the_old_additive_seeds_overlapped_where_the_derived_ones_do_not():
    # request g's sample j and request g+1's sample j-1 shared seed + g + j; seed 0 rank 1 = seed 1_000_003
    old = lambda seed, rank, g, j: seed + rank * 1_000_003 + g + j  # noqa: E731
    assert old(0, 0, 0, 1) == old(0, 0, 1, 0) and old(0, 1, 0, 0) == old(1_000_003, 0, 0, 0)
    build = request_builder(0, 0)
    first, second = (build([{"prompt": "p"}], g).split(1)[0].seed for g in (0, 1))
    assert derive_seeds(first, 2)[1] != derive_seeds(second, 2)[0]
    assert (
        request_builder(0, 1)([{"prompt": "p"}], 0).seed
        != request_builder(1_000_003, 0)([{"prompt": "p"}], 0).seed
    )


def test_the_request_seed_hashes_seed_rank_and_gen_id_and_split_parts_hash_the_part_index():
    request = request_builder(5, 2)([{"prompt": str(i)} for i in range(5)], 9)
    assert request.seed == derive_seed(5, 2, 9) and request.gen_id == 9
    parts = request.split(3)
    assert [len(p.records) for p in parts] == [2, 2, 1]
    assert [p.seed for p in parts] == [derive_seed(request.seed, p) for p in range(3)]
    unseeded = RolloutRequest(records=request.records, n=2, seed=None)
    assert [p.seed for p in unseeded.split(3)] == [None, None, None]
    assert derive_seeds(None, 3) == [None, None, None]


# -- each engine's per-sample seed path ----------------------------------------------------------------
class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


POLICY = SimpleNamespace(prompt_ids=lambda tok, record: [int(record["prompt"])], stop_ids=lambda tok: [0])
RECORDS = [{"prompt": "11"}, {"prompt": "22"}]


def token_of(seed: int | None) -> int:
    return 1 + (seed or 0) % 997  # a stand-in engine "samples" a token from the row's seed


@pytest.mark.parametrize("seed", [4, None])
def test_vllm_seeds_each_sample_as_its_own_request_with_derive_seeds(seed):
    engine = object.__new__(VLLMEngine)
    engine.tokenizer, engine.policy, engine.weight_version = Tokenizer(), POLICY, 0
    engine.llm = SimpleNamespace()  # no model config: no context limit to check
    engine._params = lambda sampling, n, row_seed: SimpleNamespace(n=n, seed=row_seed)
    sent = {}

    def run(rows, params):
        sent["rows"], sent["params"] = rows, params
        return [
            SimpleNamespace(
                outputs=[
                    SimpleNamespace(
                        token_ids=[token_of(p.seed)],
                        logprobs=[{token_of(p.seed): SimpleNamespace(logprob=-0.5)}],
                        finish_reason="length",
                    )
                ]
            )
            for p in params
        ]

    engine._run = run
    groups = engine.generate(RolloutRequest(RECORDS, n=3, sampling=SamplingParams(), seed=seed, gen_id=2))
    expected = derive_seeds(seed, 6)  # sample k = record i's j-th, k = 3 * i + j
    assert sent["rows"] == [[11]] * 3 + [[22]] * 3
    assert [(p.n, p.seed) for p in sent["params"]] == [(1, s) for s in expected]
    assert [[r.completion_ids[0] for r in g] for g in groups] == [
        [token_of(s) for s in expected[:3]],
        [token_of(s) for s in expected[3:]],
    ]
    assert [(r.group_id, r.prompt_ids, r.gen_id) for g in groups for r in g][::3] == [
        (0, [11], 2),
        (1, [22], 2),
    ]
    engine.generate_ids([[1], [2]], SamplingParams(), seed)
    assert [(p.n, p.seed) for p in sent["params"]] == [(1, s) for s in derive_seeds(seed, 2)]


@pytest.mark.parametrize(("deterministic", "seed"), [(True, 4), (True, None), (False, 4)])
def test_sglang_seeds_each_sample_with_derive_seeds_in_deterministic_mode(deterministic, seed):
    engine = object.__new__(SGLangEngine)
    engine.tokenizer, engine.policy, engine.weight_version = Tokenizer(), POLICY, 0
    engine.config = SimpleNamespace(deterministic=deterministic, sampling_overrides={})
    engine._asleep, engine._lora_name = False, None
    sent = {}

    def generate(input_ids, sampling_params, return_logprob, **kwargs):
        sent["rows"], sent["params"] = input_ids, sampling_params
        return [
            {
                "meta_info": {
                    "output_token_logprobs": [(-0.5, token_of(p.get("sampling_seed")), None)],
                    "finish_reason": {"type": "length"},
                }
            }
            for p in sampling_params
        ]

    engine.engine = SimpleNamespace(generate=generate)
    groups = engine.generate(RolloutRequest(RECORDS, n=3, sampling=SamplingParams(), seed=seed))
    assert sent["rows"] == [[11]] * 3 + [[22]] * 3
    seeds = [p.get("sampling_seed") for p in sent["params"]]
    assert seeds == (derive_seeds(seed, 6) if deterministic else [None] * 6)
    assert [r.completion_ids[0] for g in groups for r in g] == [token_of(s) for s in seeds]


@pytest.mark.parametrize("seed", [4, None])
def test_diffusion_seeds_each_chunk_with_derive_seed_of_the_chunk_index(seed):
    engine = object.__new__(DiffusionEngine)
    engine.config = SimpleNamespace(max_batch_size=4)  # n=2: two records per chunk
    engine.pipeline = SimpleNamespace(conditional=True)
    chunks = []

    def generate_chunk(records, n, sampling, chunk_seed, group_offset):
        chunks.append((len(records), chunk_seed, group_offset))
        return [[chunk_seed] * n for _ in records]

    engine._generate_chunk = generate_chunk
    records = [{"prompt": str(i)} for i in range(5)]
    groups = engine.generate(RolloutRequest(records, n=2, sampling=DiffusionSampling(num_steps=2), seed=seed))
    expected = [None] * 3 if seed is None else [derive_seed(seed, c) for c in range(3)]
    assert chunks == [(2, expected[0], 0), (2, expected[1], 2), (1, expected[2], 4)]
    assert len(groups) == 5


# -- seed_everything reaches every default seed ------------------------------------------------------
def test_the_strategys_rollout_seed_follows_seed_everything_unless_given():  # conftest unsets it
    from lightning.pytorch import seed_everything

    from unirl_lightning import AsyncRolloutStrategy

    assert AsyncRolloutStrategy().rollout.seed == 0  # no global seed: 0, as before
    seed_everything(5)
    assert AsyncRolloutStrategy().rollout.seed == 5
    assert AsyncRolloutStrategy(seed=2).rollout.seed == 2  # an explicit seed wins
    assert settings(None, 0).seed == 5  # the settings record resolves None itself


def test_lora_adapters_are_initialised_from_the_global_seed_and_the_engine_draws_the_same():
    import torch
    from lightning.pytorch import seed_everything

    from unirl_lightning import GRPOModule
    from unirl_lightning.engines.hf import HFEngineConfig
    from unirl_lightning.models.causal_lm import TinyCausalLM
    from unirl_lightning.models.lora import LoraSpec

    def adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in model.state_dict().items() if "lora_A" in k}

    built = {}
    for seed in (0, 1):
        seed_everything(seed)
        module = GRPOModule(policy=TinyCausalLM(), lora=LoraSpec(rank=2, alpha=4))
        assert module.lora.init_seed == seed  # resolved when the module is built, so it travels
        engine = HFEngineConfig(device="cpu").build(module.policy_spec, module.rollout_spec().lora)
        built[seed] = adapters(module.policy)
        assert built[seed] and all(torch.equal(built[seed][k], v) for k, v in adapters(engine.model).items())
    assert any(not torch.equal(built[0][k], built[1][k]) for k in built[0])  # seeds differ: adapters differ
    seed_everything(1)
    fixed = GRPOModule(policy=TinyCausalLM(), lora=LoraSpec(rank=2, alpha=4, init_seed=0))
    assert all(torch.equal(adapters(fixed.policy)[k], built[0][k]) for k in built[0])  # init_seed wins
