"""GPU paths that would fail on their first CUDA run, each fixed or refused and pinned by the closest CPU
stand-in: colocate + collective (NCCL refuses two ranks on one GPU), the collective backend when the
workers' actors hold no GPU, vLLM's ``sleep_level: 2`` (no copy of the weights is kept), pushes of
models transformers renames (MoE, vision-language), and SGLang's memory saver without a weight backup.
vLLM's executor for ``tensor_parallel_size > 1`` is pinned on a Ray cluster declaring GPUs in
``tests/integration/test_vllm_executor.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from unirl_lightning.cli.app import run_cli, run_plan
from unirl_lightning.core.device_rules import collective_backend, collective_device_error, sleep_level_error
from unirl_lightning.engines.serving import ServedPolicy, check_checkpoint_names
from unirl_lightning.engines.sglang import SGLangEngineConfig, sglang_engine_kwargs
from unirl_lightning.engines.vllm import VLLMEngine, VLLMEngineConfig
from unirl_lightning.models.causal_lm import TinyCausalLM
from unirl_lightning.models.lora import LoraSpec
from unirl_lightning.strategy import AsyncRolloutStrategy
from unirl_lightning.weight_sync import CollectiveWeightSync

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY_COLOCATE = [
    "--config",
    str(EXAMPLES / "grpo_tiny.yaml"),
    "--trainer.strategy.init_args.placement=colocate",
    "--trainer.strategy.init_args.max_staleness=0",
    "--trainer.strategy.init_args.max_inflight=1",
    "--trainer.strategy.init_args.num_gpus_per_worker=0.5",  # the engine on the trainer's GPU
]
LORA_1GPU = str(EXAMPLES / "grpo_qwen2.5_0.5b_lora_1gpu.yaml")
COLLECTIVE = "--trainer.strategy.init_args.weight_sync=collective"
SLEEP_2 = "--trainer.strategy.init_args.engine.init_args.sleep_level=2"


def fit_exit(args: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["fit", *args])
    return exit_info.value.code, capsys.readouterr().err.strip().splitlines()[-1]


def plan_errors(args: list[str], tmp_path: Path) -> list[dict]:
    """``plan``'s error findings (it exits 1 when there are any)."""
    out = tmp_path / "plan.json"
    try:
        run_plan([*args, "--output", str(out)])
    except SystemExit as exit_info:
        assert exit_info.code == 1
    return [f for f in json.loads(out.read_text())["findings"] if f["level"] == "error"]


# -- 1. colocate + collective ------------------------------------------------------------------------
def test_colocate_with_a_collective_sync_on_a_gpu_is_refused_naming_the_working_backend():
    error = collective_device_error("colocate", "collective", "auto", "cuda", 0.5)
    assert "Duplicate GPU detected" in error and "weight_sync='object_store'" in error
    assert collective_device_error("colocate", "collective", "auto", "cpu", 0) is None  # gloo on the host
    assert collective_device_error("separate", "collective", "auto", "cuda", 1) is None
    assert collective_device_error("colocate", "object_store", "auto", "cuda", 1) is None


def test_nccl_with_a_share_of_a_gpu_per_worker_is_refused_as_ray_may_pack_the_group_on_one_gpu():
    error = collective_device_error("separate", "collective", "auto", "cuda", 0.5)
    assert "num_gpus_per_worker=0.5" in error and "Duplicate GPU detected" in error
    assert "backend='gloo'" in error and "whole GPU" in error
    assert collective_device_error("separate", "collective", "gloo", "cuda", 0.5) is None
    assert collective_device_error("separate", "collective", "nccl", "cuda", 1) is None


def test_fit_refuses_colocate_and_collective_on_a_gpu_at_parse_time(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, last = fit_exit([*TINY_COLOCATE, COLLECTIVE, "--trainer.accelerator=gpu"], capsys)
    assert code == 2
    assert last.startswith("error: trainer.strategy.init_args.weight_sync: placement='colocate'"), last
    assert not any(tmp_path.iterdir())


def test_plan_refuses_colocate_and_collective_on_the_1gpu_recipe(tmp_path):
    errors = plan_errors(["--config", LORA_1GPU, COLLECTIVE], tmp_path)
    assert [e["key"] for e in errors] == ["trainer.strategy.init_args.weight_sync"]
    assert "Duplicate GPU detected" in errors[0]["message"]
    assert plan_errors(["--config", LORA_1GPU], tmp_path) == []  # as shipped (object_store)


# -- 3. the collective backend follows both ends -------------------------------------------------------
def test_auto_is_nccl_only_when_the_trainer_and_the_actors_hold_gpus():
    assert collective_backend("auto", "cuda", 1) == "nccl"
    assert collective_backend("auto", "cuda", 0) == "gloo"  # CPU workers (engine: hf), or per_gpu actors
    assert collective_backend("auto", "cpu", 1) == "gloo"
    sync = CollectiveWeightSync()
    assert sync.resolved_backend(torch.device("cuda", 0)) == "nccl"  # before the strategy says otherwise
    sync.for_workers(0)
    assert sync.resolved_backend(torch.device("cuda", 0)) == "gloo"


def test_the_strategy_tells_the_sync_what_the_actors_hold_and_refuses_nccl_without_gpus():
    cpu_workers = AsyncRolloutStrategy(engine="hf", weight_sync="collective", num_gpus_per_worker=0)
    cpu_workers.preflight(world_size=1)
    assert cpu_workers.weight_sync.actor_gpus == 0
    per_gpu = AsyncRolloutStrategy(
        engine="vllm", weight_sync="collective", num_gpus_per_worker=2, worker_layout="per_gpu"
    )
    per_gpu.preflight(world_size=1)
    assert per_gpu.weight_sync.actor_gpus == 0  # vLLM's own workers hold the GPUs, the actor none
    assert "needs a GPU in every worker's actor" in collective_device_error(
        "separate", "collective", "nccl", "cuda", 0
    )
    nccl = AsyncRolloutStrategy(
        engine="hf", weight_sync=CollectiveWeightSync(backend="nccl"), num_gpus_per_worker=0
    )
    with pytest.raises(ValueError, match="needs a GPU in every worker's actor"):
        nccl.preflight(world_size=1)


# -- 4. vLLM sleep level 2 ---------------------------------------------------------------------------
def test_sleep_level_2_is_refused_with_lora_and_with_pushes_less_often_than_every_step():
    assert "LoRA push restores only the adapters" in sleep_level_error(2, True, 1)
    assert "every_n_steps=2" in sleep_level_error(2, False, 2)
    assert sleep_level_error(2, False, 1) is None and sleep_level_error(1, True, 4) is None
    with pytest.raises(ValueError, match="sleep_level=2"):
        VLLMEngineConfig(sleep_level=2).validate(TinyCausalLM(), LoraSpec(rank=8))


def test_plan_and_fit_refuse_sleep_level_2_on_the_lora_recipe(capsys, tmp_path, monkeypatch):
    errors = plan_errors(["--config", LORA_1GPU, SLEEP_2], tmp_path)
    assert [e["key"] for e in errors] == ["trainer.strategy.init_args.engine.init_args.sleep_level"]
    monkeypatch.chdir(tmp_path)
    code, last = fit_exit(["--config", LORA_1GPU, SLEEP_2], capsys)
    assert code == 2 and "LoRA push restores only the adapters" in last, last


def test_the_strategy_refuses_sleep_level_2_when_the_sync_skips_steps():
    strategy = AsyncRolloutStrategy(
        engine=VLLMEngineConfig(sleep_level=2), placement="colocate", max_staleness=0, max_inflight=1
    )
    strategy.sync_interval = 2  # what WeightSyncCallback(every_n_steps=2).setup hands over
    with pytest.raises(ValueError, match="every_n_steps=2"):
        strategy.preflight(world_size=1)


class SleepingLLM:
    """vLLM's ``LLM`` where only CUDA has sleep mode: records the calls (the stand-in for level 2)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append("wake_up")

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        self.calls.append(method)
        return []

    def reset_prefix_cache(self) -> None:
        pass

    def generate(self, *args, **kwargs) -> list:
        self.calls.append("generate")
        return []


def sleeping_engine(level: int) -> VLLMEngine:
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM here: the engine's bookkeeping around a fake LLM
    engine.config, engine.llm, engine.lora = VLLMEngineConfig(sleep_level=level), SleepingLLM(), None
    engine.sleep_supported, engine._asleep, engine._weights_dropped = True, set(), False
    engine.weight_version, engine.weight_update, engine.in_process, engine._lora_request = (
        3,
        "load_weights",
        True,
        None,
    )
    return engine


def test_an_engine_slept_at_level_2_refuses_to_generate_until_a_full_push():
    engine = sleeping_engine(2)
    engine.sleep()
    with pytest.raises(RuntimeError, match="sleep_level=2, which drops the weights"):
        engine._run([[1, 2]], [None])
    assert "generate" not in engine.llm.calls
    engine.load_weights([("model.embed_tokens.weight", torch.zeros(2, 2))], 4)
    engine._run([[1, 2]], [None])
    assert engine.llm.calls[-1] == "generate"
    level_1 = sleeping_engine(1)
    level_1.sleep()
    level_1._run([[1, 2]], [None])  # level 1 keeps the weights on the host: generation may go on


# -- 9. weights transformers renames -----------------------------------------------------------------
@pytest.mark.parametrize("config_name", ["Qwen2MoeConfig", "MixtralConfig"])
def test_a_moe_policy_is_refused_for_vllm_and_sglang_and_a_dense_one_is_not(config_name, tmp_path):
    import transformers

    small = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128,
    )
    config = (
        getattr(transformers, config_name)(num_experts=4, **small)
        if config_name == "Qwen2MoeConfig"
        else (transformers.MixtralConfig(num_local_experts=4, **small))
    )
    config.save_pretrained(tmp_path / "moe")
    served = ServedPolicy(str(tmp_path / "moe"), "float32", False, None)
    for engine in ("vllm", "sglang"):
        with pytest.raises(ValueError, match=f"model_type='{config.model_type}'"):
            check_checkpoint_names(served, engine)
    transformers.LlamaConfig(**small).save_pretrained(tmp_path / "dense")
    check_checkpoint_names(ServedPolicy(str(tmp_path / "dense"), "float32", False, None), "vllm")
    assert json.loads((tmp_path / "moe" / "config.json").read_text())["model_type"] == config.model_type


def test_plan_refuses_vllm_for_a_moe_model_config(tmp_path):
    import transformers

    config = transformers.Qwen2MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=256,
        num_experts=4,
    )
    config.save_pretrained(tmp_path / "moe")
    errors = plan_errors(["--config", LORA_1GPU, "--model_config", str(tmp_path / "moe")], tmp_path)
    assert [e["key"] for e in errors] == ["trainer.strategy.init_args.engine"]
    assert "model_type='qwen2_moe'" in errors[0]["message"] and "engine='hf'" in errors[0]["message"]


def test_fit_refuses_vllm_for_a_local_moe_policy_at_parse_time(tmp_path, capsys, monkeypatch):
    import transformers

    transformers.MixtralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=256,
        num_local_experts=4,
    ).save_pretrained(tmp_path / "moe")
    monkeypatch.chdir(tmp_path)
    recipe = str(EXAMPLES / "grpo_smollm2_cpu.yaml")
    args = ["--config", recipe, "--trainer.strategy.init_args.engine=vllm"]
    code, last = fit_exit(
        [*args, f"--model.init_args.policy.init_args.name_or_path={tmp_path / 'moe'}"], capsys
    )
    assert code == 2
    assert (
        last.startswith("error: trainer.strategy.init_args.engine: engine='vllm'") and "'mixtral'" in last
    ), last


# -- 10. SGLang's memory saver keeps a copy of the weights ---------------------------------------------
def test_sglang_with_the_memory_saver_backs_the_weights_up_on_the_host():
    served = ServedPolicy("/models/p", "bfloat16", False, None)
    kwargs = sglang_engine_kwargs(SGLangEngineConfig(enable_memory_saver=True), served, None)
    assert kwargs["enable_memory_saver"] is True and kwargs["enable_weights_cpu_backup"] is True
    assert "enable_weights_cpu_backup" not in sglang_engine_kwargs(SGLangEngineConfig(), served, None)


# -- 8. the relay loads whole layers as they arrive ------------------------------------------------------
def test_a_bucket_is_loaded_up_to_its_last_layer_which_the_next_bucket_may_continue():
    from unirl_lightning.engines.vllm_weights import whole_layers_first

    t = torch.zeros(1)
    bucket = [
        ("model.embed_tokens.weight", t),
        ("model.layers.0.q.weight", t),
        ("model.layers.0.k.weight", t),
        ("model.layers.1.q.weight", t),
    ]
    complete, carry = whole_layers_first(bucket)
    assert [n for n, _ in complete] == [n for n, _ in bucket[:3]]
    assert [n for n, _ in carry] == ["model.layers.1.q.weight"]
    complete, carry = whole_layers_first(carry + [("model.layers.1.k.weight", t), ("model.norm.weight", t)])
    assert [n for n, _ in complete] == ["model.layers.1.q.weight", "model.layers.1.k.weight"]
    assert [n for n, _ in carry] == ["model.norm.weight"]
    assert whole_layers_first([]) == ([], [])


# -- 7. a GPU an engine shares -----------------------------------------------------------------------
UTILIZATION = "--trainer.strategy.init_args.engine.init_args.gpu_memory_utilization"


def test_plan_adds_the_engine_share_to_what_the_trainer_holds_on_the_1gpu_recipe(tmp_path):
    out = tmp_path / "plan.json"
    run_plan(["--config", LORA_1GPU, "--output", str(out)])
    shared = json.loads(out.read_text())["figures"]["shared_gpu"]
    # LoRA on Qwen2.5-0.5B beside vLLM at 0.45 x 24 GiB: the bf16 base, the adapters' masters and moments
    assert shared["engine_gib"] == pytest.approx(0.45 * 24)
    assert shared["frozen_gib"] == pytest.approx(0.92, abs=0.01)
    assert shared["total_gib"] == pytest.approx(
        shared["engine_gib"] + shared["masters_gib"] + shared["frozen_gib"] + shared["moments_gib"], abs=0.02
    )
    errors = plan_errors(["--config", LORA_1GPU, f"{UTILIZATION}=0.97"], tmp_path)
    assert [e["key"] for e in errors] == [UTILIZATION[2:]]
    assert "vLLM fails at start or at wake" in errors[0]["message"] and "below 0.95" in errors[0]["message"]


def test_engines_packed_on_a_shared_gpu_must_split_it(tmp_path, capsys, monkeypatch):
    gsm8k = str(EXAMPLES / "grpo_qwen2.5_0.5b_gsm8k.yaml")
    half = "--trainer.strategy.init_args.num_gpus_per_worker=0.5"
    store = "--trainer.strategy.init_args.weight_sync=object_store"  # NCCL with packed workers: refused too
    engine = {"class_path": "unirl_lightning.engines.vllm.VLLMEngineConfig", "init_args": {}}

    def utilization(value: float) -> str:
        return "--trainer.strategy.init_args.engine=" + json.dumps(
            {**engine, "init_args": {"gpu_memory_utilization": value}}
        )

    errors = plan_errors(["--config", gsm8k, half, store, utilization(0.8)], tmp_path)
    assert [e["key"] for e in errors] == [UTILIZATION[2:]]
    assert "packs 2 vLLM engines on one GPU" in errors[0]["message"]
    assert plan_errors(["--config", gsm8k, half, store, utilization(0.45)], tmp_path) == []
    errors = plan_errors(
        ["--config", gsm8k, half, store, utilization(0.5)], tmp_path
    )  # the share itself: too much
    assert (
        "beside each engine's CUDA context" in errors[0]["message"] and "at most 0.45" in errors[0]["message"]
    )
    monkeypatch.chdir(tmp_path)
    code, last = fit_exit(["--config", gsm8k, half, store, utilization(0.8)], capsys)
    assert code == 2 and "packs 2 vLLM engines on one GPU" in last, last


def test_the_optimizer_offload_frees_the_moments_under_colocate_only():
    from unirl_lightning.core.device_rules import shared_gpu_memory_error

    sizes = dict(
        gpu_gib=80, engine_gib=60, masters_gib=10, frozen_gib=0, moments_gib=20, num_gpus_per_worker=1
    )
    assert "offload_optimizer: true" in shared_gpu_memory_error(
        "colocate", offload_optimizer=False, utilization=0.75, **sizes
    )
    assert shared_gpu_memory_error("colocate", offload_optimizer=True, utilization=0.75, **sizes) is None
    assert shared_gpu_memory_error("hybrid", offload_optimizer=True, utilization=0.75, **sizes) is not None
