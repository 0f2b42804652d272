"""One update of ours against one of TRL's ``GRPOTrainer``, update for update, on the SmolLM2 LoRA recipe.

Three batches are sampled at once with the recipe's settings (``examples/grpo_smollm2_cpu.yaml``:
SmolLM2-135M-Instruct, LoRA rank 16, 2 prompts x 8 samples x 64 tokens at temperature 0.6,
``dr_grpo``, lr 4e-4, clipping at 1.0), by our HF engine from the initial adapters. Both sides start
from copies of the same ``PeftModel`` and apply three consecutive updates, one per batch, on the same
tokens, masks, behaviour log-probs and advantages:

* ours: ``prepare_batch``, the mini-batch backward (``policy_loss``), clip at 1.0, our AdamW step;
* TRL's: ``GRPOTrainer._compute_loss`` (``loss_type="dapo"``, the same ``num_items_in_batch``, the
  behaviour log-probs as ``old_per_token_logps``), backward, clip at 1.0, the optimizer its
  ``create_optimizer`` builds.

Before each step the gradients must agree (cosine >= 0.9999 and norm ratio within 1e-3, per adapter
tensor and overall), and after it the adapters' deltas. Deltas alone would be blind to the gradient's
scale: one AdamW step from a zero LoRA B moves every entry by about lr x sign. The figures are
printed (``pytest -s``) for the record.

Measured (CPU, float32): update 1 gradients cosine >= 0.9999999997 per tensor, norm ratio within 1.9e-5;
updates 2 and 3 (the batches were sampled before the earlier updates: ratios up to 3.2 and 3.8) cosine
>= 0.999998 per tensor, norm ratio within 3e-4; overall cosine >= 0.99999999988 at every update. Our
default dual-clip (``clip_ratio_c=3.0``) is off here: TRL has none, and a token whose ratio passed 3 under
a negative advantage (4 tokens of update 3's batch) then loses its gradient on our side only (on an
earlier draw of the batches one such token turned the worst tensor's cosine to 0.85); on-policy (ratio 1)
it never acts.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.unit.real_model import needs_smollm2

pytestmark = [pytest.mark.slow, needs_smollm2]

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "grpo_smollm2_cpu.yaml"
UPDATES = 3


def recipe(tmp_path, monkeypatch):
    from unirl_lightning.cli.app import UniRLCLI

    monkeypatch.chdir(tmp_path)  # the parsed logger and checkpoint folders land here, unused
    # TRL has no dual-clip: with the recipe's clip_ratio_c=3.0 a token whose ratio passed 3 under a
    # negative advantage loses its gradient on our side only (on an earlier draw of the batches one such
    # token turned the worst tensor's cosine to 0.85, the overall one to 0.9946)
    cli = UniRLCLI(
        args=["--config", str(RECIPE), "--seed_everything", "0", "--model.init_args.clip_ratio_c=null"],
        run=False,
    )
    return cli.model, cli.datamodule


def sample_batches(module, data) -> list:
    """The three batches of the recipe's ``batch_size`` prompts x ``num_generations``, sampled in one
    request (one generate over all their rows: a third of the decode steps of three requests)."""
    from unirl_lightning.engines.hf import HFEngineConfig
    from unirl_lightning.rollout.batches import ExperienceBatch
    from unirl_lightning.rollout.records import RolloutRequest

    engine = HFEngineConfig(device="cpu", num_threads=None).build(module.policy_spec, module.lora)
    per = data.batch_size
    request = RolloutRequest(
        records=[dict(r) for r in data.train_records()[: per * UPDATES]],
        n=module.num_generations,
        sampling=module.sampling,
        seed=0,
    )
    groups = engine.generate(request)
    assert len(groups) == per * UPDATES and all(len(g) == module.num_generations for g in groups)
    texts = [r.text for g in groups for r in g]
    rewards = module.reward(texts, [rec for rec, g in zip(request.records, groups) for _ in g])
    for rollout, reward in zip((r for g in groups for r in g), rewards):
        rollout.reward = float(reward)
    return [
        ExperienceBatch.collate(groups[per * k : per * (k + 1)], pad_token_id=module.tokenizer.pad_token_id)
        for k in range(UPDATES)
    ]


def record_logprobs(module) -> list[torch.Tensor]:
    """Keep what the module's own forwards return (the log-probs of the update's forward), so the
    off-policy figures printed below cost no forward of their own."""
    seen, compute = [], module.sequence_logprobs

    def recording(*args, **kwargs):
        out = compute(*args, **kwargs)
        seen.append((out[0] if isinstance(out, tuple) else out).detach())
        return out

    module.sequence_logprobs = recording
    return seen


def trl_inputs(batch, advantages, pad_id: int) -> dict[str, torch.Tensor]:
    """The batch as TRL's ``_compute_loss`` takes it: left-padded prompts, right-padded completions."""
    prompts, completions, logprobs = [], [], []
    for ids, attn, resp, lp in zip(
        batch.input_ids, batch.attention_mask, batch.response_mask, batch.rollout_logprobs
    ):
        attn, resp = attn.bool(), resp.bool()
        prompts.append(ids[attn & ~resp])
        completions.append(ids[resp])
        logprobs.append(lp[resp])
    p_len, c_len = max(len(p) for p in prompts), max(len(c) for c in completions)
    n = len(prompts)
    prompt_ids = torch.full((n, p_len), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, p_len), dtype=torch.long)
    completion_ids = torch.full((n, c_len), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((n, c_len), dtype=torch.long)
    old = torch.zeros((n, c_len))
    for i, (p, c, lp) in enumerate(zip(prompts, completions, logprobs)):
        prompt_ids[i, p_len - len(p) :], prompt_mask[i, p_len - len(p) :] = p, 1
        completion_ids[i, : len(c)], completion_mask[i, : len(c)] = c, 1
        old[i, : len(c)] = lp
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages.float(),
        "old_per_token_logps": old,
        "num_items_in_batch": completion_mask.sum(),
    }


def make_trl_trainer(module, model, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=2 * module.num_generations,
        num_generations=module.num_generations,
        max_completion_length=module.sampling.max_new_tokens,
        temperature=module.sampling.temperature,
        learning_rate=module.lr,
        lr_scheduler_type="constant",
        weight_decay=module.weight_decay,
        adam_beta1=module.betas[0],
        adam_beta2=module.betas[1],
        max_grad_norm=module.max_grad_norm,
        beta=module.kl_coef,
        epsilon=module.loss_settings.clip_low,
        epsilon_high=module.loss_settings.clip_high,
        loss_type="dapo",
        scale_rewards="none",
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * 2),
        processing_class=module.tokenizer,
    )
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets for one batch per step
    return trainer


def adapters(model) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def agreement(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> dict[str, float]:
    """The worst per-tensor cosine and norm ratio (tensors zero on both sides skipped), and overall."""
    ours = {n: t.double() for n, t in ours.items()}  # float64: a float32 cosine over 4M entries drifts
    theirs = {n: t.double() for n, t in theirs.items()}
    worst_cos, worst_ratio, zero = 1.0, 1.0, 0
    for name, a in ours.items():
        b = theirs[name]
        na, nb = float(a.norm()), float(b.norm())
        if na < 1e-12 and nb < 1e-12:
            zero += 1
            continue
        cos = float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))
        worst_cos, worst_ratio = min(worst_cos, cos), max(worst_ratio, abs(na / nb - 1) + 1)
    flat_a = torch.cat([t.flatten() for t in ours.values()])
    flat_b = torch.cat([theirs[n].flatten() for n in ours])
    overall_cos = float(torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=0))
    return {
        "worst_cosine": worst_cos,
        "worst_norm_ratio_dev": worst_ratio - 1,
        "overall_cosine": overall_cos,
        "overall_norm_ratio_dev": abs(float(flat_a.norm()) / float(flat_b.norm()) - 1),
        "zero_tensors": zero,
    }


def test_three_updates_match_trls_update_for_update(tmp_path, monkeypatch):
    torch.manual_seed(0)
    module, data = recipe(tmp_path, monkeypatch)
    module.setup("fit")
    theirs_model = copy.deepcopy(module.policy)  # the same PeftModel, adapters as initialised
    batches = sample_batches(module, data)
    optimizer = module.configure_optimizers()
    module.optimizers = lambda: optimizer
    module.manual_backward = lambda loss: loss.backward()
    trainer = make_trl_trainer(module, theirs_model, tmp_path)
    seen = record_logprobs(module)
    theirs_model.train()
    ours_params, theirs_params = adapters(module.policy), adapters(theirs_model)
    assert ours_params.keys() == theirs_params.keys() and len(ours_params) > 0
    for step, batch in enumerate(batches):
        before_ours = {n: p.detach().clone() for n, p in ours_params.items()}
        before_theirs = {n: p.detach().clone() for n, p in theirs_params.items()}
        optimizer.zero_grad()
        context = module.prepare_batch(batch)
        seen.clear()
        module.backward_minibatch(batch, context)
        assert len(seen) == 1, "one forward over the whole batch (no micro-batches in the recipe)"
        trainer.optimizer.zero_grad()
        loss = trainer._compute_loss(
            theirs_model, trl_inputs(batch, context.advantages, module.tokenizer.pad_token_id)
        )
        loss.backward()
        with torch.no_grad():  # how far off-policy the batch is for the weights being updated
            mask = batch.response_mask[:, 1:].bool()
            ratio = torch.exp(seen[0] - batch.rollout_logprobs[:, 1:])[mask]
            negative = context.advantages[:, None].expand_as(mask)[mask] < 0
            print(
                f"update {step + 1}: ratio max {float(ratio.max()):.3f}, tokens with A<0 and ratio>3: "
                f"{int(((ratio > 3) & negative).sum())} of {int(mask.sum())}"
            )
        grads = agreement(
            {n: p.grad.detach().clone() for n, p in ours_params.items()},
            {n: p.grad.detach().clone() for n, p in theirs_params.items()},
        )
        torch.nn.utils.clip_grad_norm_(list(ours_params.values()), module.max_grad_norm)
        torch.nn.utils.clip_grad_norm_(list(theirs_params.values()), module.max_grad_norm)
        optimizer.step()
        trainer.optimizer.step()
        deltas = agreement(
            {n: p.detach() - before_ours[n] for n, p in ours_params.items()},
            {n: p.detach() - before_theirs[n] for n, p in theirs_params.items()},
        )
        print(f"update {step + 1}: gradients {grads}; deltas {deltas}")
        for figures in (grads, deltas):
            assert figures["worst_cosine"] >= 0.9999 and figures["overall_cosine"] >= 0.9999, figures
            assert figures["worst_norm_ratio_dev"] <= 1e-3 and figures["overall_norm_ratio_dev"] <= 1e-3, (
                figures
            )
