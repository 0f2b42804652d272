"""Which reasoning-gym task SmolLM2-135M-Instruct can partly solve before training (issue 50): the start
accuracy of a few tasks at an easy difficulty, measured the way the recipe evaluates and samples.

    python -m benchmarks.peers.reasoning_gym_tasks [--prompts 32] [--tasks basic_arithmetic chain_sum]

For each task: ``--prompts`` held-out prompts (reasoning-gym's partition the training side never draws
from), the question as reasoning-gym writes it, rendered with the chat template; the answer read by
``--answer-format`` (default ``last_number``: the last number of the reply; ``answer_tag`` adds
reasoning-gym's own ``direct`` system prompt). The untrained model answers

* greedily (the recipe's evaluation): the share scored 1.0 by the dataset's own ``score_answer``,
  and the share giving an answer in the format at all;
* sampled, ``--samples`` per prompt at the recipe's temperature: the mean score and the share of
  prompts whose group has both a right and a wrong sample (a group GRPO can learn from; a group all
  right or all wrong has zero advantage).

A task fit for a short CPU run has a greedy start accuracy well above zero and well below one, and many
mixed groups. Results: ``benchmarks/results/reasoning_gym_tasks.json``.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.harness import common, stats

# easy settings of each candidate (reasoning-gym 0.1.25's config keys)
TASKS: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 2,
        "operators": ["+", "-"],
        "allow_parentheses": False,
        "allow_negation": False,
    },
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "leg_counting": {"min_animals": 1, "max_animals": 2, "min_instances": 1, "max_instances": 3},
    "gcd": {"min_value": 1, "max_value": 30},
    "spell_backward": {"min_word_len": 3, "max_word_len": 4},
}


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    from reasoning_gym.utils import SYSTEM_PROMPTS

    from unirl_lightning.core.prompts import render_prompt_text
    from unirl_lightning.data.reasoning_gym import reasoning_gym_records
    from unirl_lightning.models import PretrainedCausalLM
    from unirl_lightning.rewards.reasoning_gym import ReasoningGymReward, extract

    torch.manual_seed(0)
    spec = PretrainedCausalLM("smollm2-135m-instruct", dtype="float32", chat=True)
    model, tokenizer = spec.build()
    model.eval()
    system = SYSTEM_PROMPTS["direct"] if cfg["answer_format"] == "answer_tag" else None
    stop_ids = list(spec.stop_ids(tokenizer))
    reward = ReasoningGymReward(answer_format=cfg["answer_format"])
    name = cfg["task"]
    records = reasoning_gym_records(f"reasoning_gym:{name}", cfg["prompts"], 1, TASKS[name], "held_out")
    texts = [render_prompt_text(tokenizer, r, chat=True, system_prompt=system) for r in records]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    started = time.perf_counter()

    def generate(**kwargs: Any) -> list[str]:
        with torch.no_grad():
            ids = model.generate(
                **batch, max_new_tokens=cfg["max_new_tokens"], eos_token_id=stop_ids,
                pad_token_id=tokenizer.pad_token_id, **kwargs,
            )  # fmt: skip
        return tokenizer.batch_decode(ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)

    greedy = generate(do_sample=False)
    scores = [reward.score(c, r) for c, r in zip(greedy, records)]
    tagged = sum(extract(c, cfg["answer_format"]) is not None for c in greedy)
    sampled = generate(do_sample=True, temperature=cfg["temperature"], num_return_sequences=cfg["samples"])
    groups = [
        [reward.score(c, r) for c in sampled[i * cfg["samples"] : (i + 1) * cfg["samples"]]]
        for i, r in enumerate(records)
    ]
    mixed = sum(any(s >= 1.0 for s in g) and any(s < 1.0 for s in g) for g in groups)
    return {
        "task": name,
        "config": TASKS[name],
        "greedy_accuracy": round(sum(s >= 1.0 for s in scores) / len(scores), 4),
        "greedy_answered": round(tagged / len(greedy), 4),  # an answer found in the format at all
        "sampled_mean_score": round(sum(map(sum, groups)) / (len(groups) * cfg["samples"]), 4),
        "mixed_groups": round(mixed / len(groups), 4),
        "examples": [
            {"question": r["prompt"][:120], "answer": r["answer"], "greedy": c[:120]}
            for r, c in list(zip(records, greedy))[:3]
        ],
        "generate_s": round(time.perf_counter() - started, 1),
    }


def run(config: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for task in config["tasks"]:
        keys = ("prompts", "samples", "temperature", "max_new_tokens", "answer_format")
        cfg = {key: config[key] for key in keys}
        try:
            result = common.run_child(__file__, {**cfg, "task": task}, timeout_s=1800)
        except RuntimeError as exc:  # e.g. a config with too few distinct held-out prompts: next task
            print(f"{task}: {exc}".splitlines()[-1], flush=True)
            rows.append({"task": task, "config": TASKS[task], "error": str(exc).splitlines()[-1]})
            continue
        print(
            {k: result[k] for k in ("task", "greedy_accuracy", "greedy_answered", "mixed_groups")}, flush=True
        )
        rows.append(result)
    return {"machine": stats.machine(), "answer_format": config["answer_format"], "tasks": rows}


def main() -> None:
    parser = common.script_parser(__doc__)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts per task")
    parser.add_argument("--samples", type=int, default=8, help="sampled completions per prompt")
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument(
        "--answer-format",
        default="last_number",
        choices=["last_number", "answer_tag", "boxed"],
        help="where the answer is read (answer_tag: with reasoning-gym's 'direct' system prompt)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: one task, 2 prompts x 2 samples")
    config = common.parse_config(parser, child=child)
    if config["quick"]:
        config.update(tasks=config["tasks"][:1], prompts=2, samples=2, max_new_tokens=8)
    results = run(config)
    if config["quick"]:
        print(results)
    else:
        common.finish(results, "reasoning_gym_tasks", config=config)


if __name__ == "__main__":
    main()
