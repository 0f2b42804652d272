"""Every benchmark the registry knows (``registry.py`` runs them): what each is, what it costs, its full
and smoke arguments and what it needs. Costs: ``seconds`` (under a minute), ``minutes`` (under ~20
minutes), ``hours`` (longer), ``gpu`` (a CUDA device), each on an idle 2-core CPU machine at the full
arguments. Needs: a Python module that must be importable (``trl``, ``diffusers``), ``smollm2`` (the
real-model extra), ``vllm`` (run in ``.venv-vllm`` when this interpreter lacks it), ``gpu``."""

from __future__ import annotations

from dataclasses import dataclass, field

COSTS = ("seconds", "minutes", "hours", "gpu")


@dataclass(frozen=True)
class Entry:
    """One benchmark: ``python -m <module> <args>``; ``smoke`` None: no smoke run (``--smoke`` says why)."""

    name: str
    kind: str  # performance, peers, simulation, gpu, harness: the folder
    cost: str  # one of COSTS, for the full arguments
    what: str
    args: tuple[str, ...] = ()
    smoke: tuple[str, ...] | None = ()
    needs: tuple[str, ...] = ()  # for the full run
    smoke_needs: tuple[str, ...] | None = None  # None: the same as needs
    venv: str | None = None  # "vllm": runs in .venv-vllm where this interpreter has no vLLM
    env: dict[str, str] = field(default_factory=dict)
    bench: bool = False  # one of make bench's

    @property
    def module(self) -> str:
        return f"benchmarks.{self.kind}.{self.name}"


TINY_GRPO = ("--hidden", "16", "--layers", "1", "--max-new-tokens", "2", "--batch", "2", "--group", "2")
ENTRIES: list[Entry] = [
    # -- performance -------------------------------------------------------------------------------
    Entry(
        "controller_overhead",
        "performance",
        "seconds",
        "controller time per group (100k groups, generation made free)",
        smoke=("--groups", "2000"),
        bench=True,
    ),
    Entry(
        "async_vs_sync",
        "performance",
        "minutes",
        "ours sync vs async, tiny GRPO, 30 steps each",
        smoke=("--steps", "1", "--warmup", "1", *TINY_GRPO),
        bench=True,
    ),
    Entry(
        "flow_grpo_throughput",
        "performance",
        "minutes",
        "Flow-GRPO images/s, sync vs async",
        smoke=(
            "--steps",
            "2",
            "--warmup",
            "1",
            "--batch-size",
            "1",
            "--num-generations",
            "2",
            "--num-steps",
            "2",
        )
        + ("--pretrain-steps", "5"),
        needs=("diffusers",),
        bench=True,
    ),
    Entry(
        "engines",
        "performance",
        "minutes",
        "HF vs vLLM-CPU on SmolLM2: tokens/s and push time (make bench-engines)",
        args=("--prompts", "8", "--n", "4", "--repeats", "2", "--warmup", "1", "--pushes", "3"),
        smoke=("--model", "tiny", "--prompts", "2", "--n", "2", "--max-new-tokens", "4", "--repeats", "1")
        + (
            "--warmup",
            "0",
            "--pushes",
            "1",
            "--hidden-size",
            "64",
            "--num-layers",
            "1",
        ),  # head size 32: vLLM-CPU's least
        needs=("vllm", "smollm2"),
        smoke_needs=(),
        venv="vllm",
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    ),
    Entry(
        "memory",
        "performance",
        "minutes",
        "peak memory of log-probs and HF generation at vocab 49152 / 151936, before vs after chunking",
        smoke=("--smoke",),
    ),
    Entry(
        "memory_step",
        "performance",
        "hours",
        "peak memory of one GRPO step against plan's estimate (tiny Llamas, SmolLM2)",
        smoke=("--smoke", "--models", "tiny-256"),
        needs=("smollm2",),
        smoke_needs=(),
    ),
    Entry(
        "rank_load_memory",
        "performance",
        "minutes",
        "host memory of 2 CPU ranks with load_once_per_node off and on (SmolLM2)",
        smoke=("--model", "tiny", "--dtype", "float32", "--parallel", "ddp", "--load-once", "on"),
        needs=("smollm2",),
        smoke_needs=(),
    ),
    Entry(
        "weight_push_paths",
        "performance",
        "minutes",
        "a full SmolLM2 push into a vLLM worker: collective vs object store",
        smoke=("--pushes", "1", "--paths", "object_store"),
        needs=("vllm", "smollm2"),
        venv="vllm",
    ),
    Entry(
        "weight_sync_ranks",
        "performance",
        "minutes",
        "sync time and bytes with 1 vs 2 training ranks (DDP, FSDP2), object store vs collective",
        smoke=("--steps", "2", "--backends", "object_store", "--parallel", "single"),
    ),
    Entry(
        "step_modules",
        "performance",
        "seconds",
        "the package modules one async RL step runs (cProfile of the tiny recipe)",
        smoke=("--steps", "3", "--from", "1", "--to", "2"),
    ),
    Entry(
        "loss_options",
        "performance",
        "hours",
        "one short run of the tiny recipes per loss and multi-turn option",
        smoke=("--only", "baseline (PPO-clip, dual-clip 3)", "--steps", "2"),
    ),
    Entry(
        "interrupt_long_tail",
        "performance",
        "minutes",
        "async quiesce vs interrupt vs sync on a long-tail length workload",
        smoke=("--rounds", "1", "--steps", "1", "--warmup", "1", *TINY_GRPO[:4], "--max-new-tokens", "4")
        + ("--batch", "2", "--group", "2", "--modes", "async_interrupt", "async_groups_continue_split2"),
    ),
    Entry(
        "interrupt_learning",
        "performance",
        "minutes",
        "held-out accuracy of the tiny recipe, quiesce vs interrupt, over seeds",
        smoke=("--seeds", "0", "--max-steps", "2", "--modes", "interrupt"),
    ),
    Entry(
        "engine_step_cost",
        "performance",
        "seconds",
        "the continuous HF engine's decode-step cost against rows and context (the simulator's engine costs here)",
        smoke=(
            "--rows",
            "1",
            "8",
            "--tokens",
            "4",
            "--rounds",
            "1",
            "--refill-slots",
            "4",
            "--refill-rows",
            "16",
        ),
    ),
    Entry(
        "batcher_refill",
        "performance",
        "minutes",
        "the continuous HF engine's refill: prompts shared, staged, unstaged (tokens/s, occupancy, prefills)",
        smoke=("--slots", "4", "--rows", "16", "--rounds", "1"),
    ),
    Entry(
        "transformers_cb",
        "performance",
        "seconds",
        "the HF engine's batcher against transformers' continuous batching: tokens/s, log-probs, seeding, a load in flight",
        smoke=("--slots", "16", "--rows", "32", "--rounds", "1"),
    ),
    Entry(
        "staleness_learning",
        "performance",
        "minutes",
        "held-out accuracy against steps and wall time: sync vs max_staleness 1/2/4 with decoupled PPO",
        smoke=("--seeds", "0", "--max-steps", "2", "--modes", "stale2", "--recipe", "streaming"),
    ),
    # -- peers -------------------------------------------------------------------------------------
    Entry(
        "vs_trl",
        "peers",
        "minutes",
        "TRL GRPOTrainer vs ours sync / async / hybrid, tiny Llamas (--stopping natural, --workloads smollm2)",
        smoke=("--runs", "1", "--steps", "1", "--steps-long", "1", "--warmup", "1", "--workloads", "base")
        + ("--configs", "trl-1t", "hybrid", "--prompts", "2", "--group", "2"),
        needs=("trl",),
    ),
    Entry(
        "time_to_accuracy",
        "peers",
        "minutes",
        "held-out accuracy against wall time and samples, ours vs TRL",
        smoke=(
            "--seeds",
            "0",
            "--configs",
            "trl",
            "sync",
            "--budget-s",
            "2",
            "--prompts",
            "2",
            "--group",
            "2",
        ),
        needs=("trl",),
    ),
    Entry(
        "smollm2_learning",
        "peers",
        "hours",
        "the SmolLM2 LoRA recipe, ours vs TRL, held-out accuracy over seeds",
        args=("--seeds", "0", "1", "--configs", "async", "sync", "trl"),
        smoke=None,  # its smallest run (--quick) loads SmolLM2 in every process and evaluates 64 problems
        needs=("trl", "smollm2"),
    ),
    Entry(
        "reasoning_gym_tasks",
        "peers",
        "minutes",
        "SmolLM2's start accuracy on easy reasoning-gym tasks (which one the recipe trains on)",
        smoke=("--quick",),
        needs=("reasoning_gym", "smollm2"),
    ),
    # -- simulation --------------------------------------------------------------------------------
    Entry(
        "simulate_async",
        "simulation",
        "minutes",
        "the real controller and loop on a discrete clock at 8 / 32 / 128 simulated GPUs",
        args=("--calibrate", "benchmarks/results/interrupt_long_tail.json"),
        smoke=("--gpus", "8", "--steps", "2", "--warmup", "1", "--prompts", "4", "--samples", "2")
        + ("--max-new-tokens", "256", "--median-len", "64", "--prompt-len", "16")
        + ("--calibrate", "benchmarks/results/interrupt_long_tail.json"),
    ),
    Entry(
        "simulate_streaming",
        "simulation",
        "minutes",
        "streaming async RL (continuous batching, syncs without draining): verl check, AReaL, ours",
        smoke=("--parts", "ours", "areal-eta", "--gpus", "8", "--train-law", "perfect")
        + ("--steps", "1", "--warmup", "1", "--verl-steps", "1"),
    ),
    # -- gpu ---------------------------------------------------------------------------------------
    Entry(
        "gpu_smoke",
        "gpu",
        "gpu",
        "one CUDA device: bf16 compute over fp32 masters, memory, engine log-probs, push, FSDP2 fit (make gpu-smoke)",
        smoke=("--cpu", "--checks", "mixed_precision", "logprob_memory", "hf_generate", "weight_push")
        + ("on_policy_pin",),
        needs=("gpu",),
        smoke_needs=(),
    ),
    # -- the figures, last -------------------------------------------------------------------------
    Entry("plot", "harness", "seconds", "redraws every figure from the results folder's JSON", bench=True),
]
