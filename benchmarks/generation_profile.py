"""Where a generation phase's time goes: ``model.generate`` in-process vs our HF engine vs a Ray worker.

    python benchmarks/generation_profile.py [--calls 5] [--threads 2] [--stopping suppressed|natural]
        [--model smollm2|tiny]

The generation of ``vs_trl.py --workloads smollm2`` (SmolLM2-135M-Instruct, float32, 4 prompts x 4
samples x 16 new tokens, temperature 1), timed in layers (``--model tiny``: ``vs_trl.py``'s base model instead, where a token's kernels are
small and per-kernel overheads show), each the median of ``--calls`` calls after
one warm-up call (the three in-process layers interleaved call by call), every layer with
``--threads`` torch threads:

* ``raw``: ``model.generate`` on the left-padded batch, in this process (what TRL's HF path calls);
* ``engine``: our ``HFEngine.generate(request)`` in this process: tokenisation, the same
  ``generate`` call with the per-step log-prob hook (``StepScorer``), stop trimming, the groups;
* ``engine-no-scorer``: the same with the hook detached (the cost of the behaviour log-probs);
* ``worker``: ``RolloutWorker.generate`` in a Ray actor (its own process, the driver blocked in
  ``ray.get``), timed inside the worker (``generate_s``) and end to end (``call_s``: submission,
  result transfer and deserialisation included);
* ``worker-beside-trainer``: the same while this process holds a second SmolLM2 copy with an
  AdamW state (the trainer's memory, idle), to see whether a resident trainer slows the worker.

Prints a table and a JSON line; writes ``benchmarks/results/generation_profile.json``.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
from typing import Any

import common


def interleaved(fns: dict[str, Any], calls: int) -> dict[str, dict[str, float]]:
    """:func:`common.interleaved` (one call of each in turn, after one warm-up call each), as the
    median, min and max seconds of each."""
    times = common.interleaved(fns, calls)
    return {
        name: {
            "median_s": round(statistics.median(t), 3),
            "min_s": round(min(t), 3),
            "max_s": round(max(t), 3),
        }
        for name, t in times.items()
    }


def timed(fn: Any, calls: int) -> dict[str, float]:
    """The median, min and max seconds of ``calls`` calls of ``fn`` after a warm-up call."""
    return interleaved({"fn": fn}, calls)["fn"]


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Every layer timed (the in-process ones interleaved); the results record."""
    common.quiet()

    import ray
    import torch

    from unirl_lightning.data.tasks import make_task
    from unirl_lightning.engines.hf import HFEngine, HFEngineConfig, StepScorer
    from unirl_lightning.models.causal_lm import PretrainedCausalLM
    from unirl_lightning.rollout.records import RolloutRequest, SamplingParams
    from unirl_lightning.workers.actor import RolloutWorker

    torch.set_num_threads(config["threads"])
    results: dict[str, Any] = {
        "threads": config["threads"],
        "stopping": config["stopping"],
        "calls": config["calls"],
    }
    with tempfile.TemporaryDirectory(prefix="genprof-") as model_dir:
        suppress = config["stopping"] == "suppressed"
        if config["model"] == "tiny":  # vs_trl.py's base model: many small kernels per token
            results["model"] = common.build_model_dir(
                model_dir, hidden=128, layers=4, intermediate=256, suppress_eos=suppress
            )
        else:
            results["model"] = common.build_smollm2_dir(model_dir, suppress_eos=suppress)
        policy = PretrainedCausalLM(name_or_path=model_dir, dtype="float32")
        records = make_task("digit_successor", config["prompts"], 0, prefix_len=8)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=config["max_new_tokens"])
        request = RolloutRequest(records=records, n=config["group"], sampling=sampling, seed=0, gen_id=0)
        engine_config = HFEngineConfig(device="cpu", num_threads=config["threads"])

        engine = HFEngine(engine_config, policy, None)
        tok = engine.tokenizer
        rows = [policy.prompt_ids(tok, r) for r in records for _ in range(config["group"])]
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])

        def raw() -> None:
            with torch.no_grad():
                engine.model.generate(
                    input_ids=input_ids,
                    attention_mask=mask,
                    do_sample=True,
                    temperature=1.0,
                    top_p=1.0,
                    top_k=0,
                    max_new_tokens=config["max_new_tokens"],
                    pad_token_id=tok.pad_token_id,
                    eos_token_id=engine.stop_ids,
                )

        @contextlib.contextmanager
        def detached(self: StepScorer, model: Any):  # noqa: ANN202
            yield self

        attached = StepScorer.attached

        def no_scorer() -> None:
            StepScorer.attached = detached  # type: ignore[method-assign]
            try:
                _ignore(engine.generate, request)  # logprobs() refuses an unscored run: the rest is timed
            finally:
                StepScorer.attached = attached  # type: ignore[method-assign]

        # the in-process layers interleaved call by call, so a slow phase of the machine hits each alike
        layers: dict[str, Any] = interleaved(
            {"raw": raw, "engine": lambda: engine.generate(request), "engine-no-scorer": no_scorer},
            config["calls"],
        )

        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": common.child_env()["PYTHONPATH"]}},
        )
        try:
            actor = ray.remote(num_cpus=1)(RolloutWorker).remote(
                engine_config, policy, None, common.FirstCharReward()
            )
            inner: list[float] = []

            def call() -> None:
                inner.append(ray.get(actor.generate.remote(request))["generate_s"])

            layers["worker"] = {
                **timed(call, config["calls"]),
                "inside_median_s": round(statistics.median(inner[1:]), 3),
            }
            trainer, _ = policy.build()
            optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-6)
            trainer(input_ids[:2], attention_mask=mask[:2]).logits.sum().backward()
            optimizer.step()  # the optimizer state exists, as in a trainer between steps
            inner.clear()
            layers["worker-beside-trainer"] = {
                **timed(call, config["calls"]),
                "inside_median_s": round(statistics.median(inner[1:]), 3),
            }
        finally:
            ray.shutdown()
    results["layers"] = layers
    return results


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument(
        "--model",
        choices=["smollm2", "tiny"],
        default="smollm2",
        help="tiny: vs_trl.py's base model (hidden 128, 4 layers)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stopping", choices=["suppressed", "natural"], default="suppressed")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", default=str(common.results_path("generation_profile")))
    config = common.parse_config(parser)
    results = run(config)
    for name, row in results["layers"].items():
        extra = f"  (inside the worker {row['inside_median_s']:.3f} s)" if "inside_median_s" in row else ""
        print(f"{name:<22} {row['median_s']:.3f} s  [{row['min_s']:.3f}-{row['max_s']:.3f}]{extra}")
    common.finish(results, config["out"], {k: v["median_s"] for k, v in results["layers"].items()}, indent=1)


def _ignore(fn: Any, *args: Any) -> None:
    with contextlib.suppress(RuntimeError):
        fn(*args)


if __name__ == "__main__":
    main()
