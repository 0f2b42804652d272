"""Micro-batches, activation checkpointing and the global token mean leave an optimizer step as it was.

A mini-batch split into micro-batches (``micro_batch_rows``, ``micro_batch_tokens``) backpropagates
the same loss and accumulates the same gradients as the whole mini-batch, and logs the same
first-mini-batch metrics, for every loss aggregation, for GRPO (KL and recomputed old log-probs: the
chunked no-grad recompute is covered), PPO (its critic too) and Flow-GRPO. Tolerance: float32,
``rtol=1e-5, atol=1e-6``, with ``lr=0`` so that every optimizer step's gradients are taken at the
same weights (measured: at most 2.5e-6 relative, 5e-8 absolute; the float sums just run in another
order). The micro-batches of the test batch hold unequal token and row counts, so a normaliser
taken per micro-batch instead of per mini-batch fails these tests: checked once by hand (each
micro-batch's loss its own mean, averaged over the micro-batches, failed every GRPO and PPO case of
every aggregation with uneven micro-batches, i.e. all but the one-row-each seq-mean ones, where the
two coincide).

Under two data-parallel ranks ``"token-mean"`` is the global token mean: two gloo ranks with unequal
token counts, their gradients averaged by DDP, get the gradient of one rank on the union of their rows.
"""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.builders import tiny_module
from unirl_lightning.modules import FlowGRPOModule, GRPOModule, PPOModule
from unirl_lightning.modules.context import TokenContext
from unirl_lightning.modules.microbatch import MicroBatcher, pack_rows_by_tokens, split_to_count
from unirl_lightning.modules.ranks import global_token_count
from unirl_lightning.modules.tokens import row_widths
from unirl_lightning.rollout.batches import ExperienceBatch
from unirl_lightning.rollout.records import Rollout

AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
MAX_NEW_TOKENS = 5


def rollouts(lengths: list[tuple[int, int]], seed: int) -> list[Rollout]:
    """One group: a row per ``(prompt length, completion length)``, behaviour log-probs off the
    trainer's (ratios away from 1, some clipped)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, (p, c) in enumerate(lengths):
        rows.append(
            Rollout(
                prompt_ids=torch.randint(3, 17, (p,), generator=g).tolist(),
                completion_ids=torch.randint(3, 17, (c,), generator=g).tolist(),
                logprobs=(-2.5 + 0.8 * torch.randn(c, generator=g)).tolist(),
                reward=float((i * 7 + seed) % 3),
                finish_reason="length",
            )
        )
    return rows


# two groups of four, prompts and completions of different lengths: the micro-batches of a
# mini-batch hold unequal token counts whatever the split (so the normaliser is tested)
GROUPS = [
    [(4, 5), (2, 1), (6, 3), (3, 5)],
    [(5, 2), (2, 4), (7, 1), (3, 5)],
]


def a_batch(groups=GROUPS, first_seed: int = 0) -> ExperienceBatch:
    """Group ``i`` drawn from seed ``first_seed + i``."""
    rows = [rollouts(g, first_seed + i) for i, g in enumerate(groups)]
    return ExperienceBatch.collate(rows, pad_token_id=0)


def one_update(module, batch) -> tuple[dict[str, torch.Tensor], list[list[torch.Tensor]], dict]:
    """``module.update`` off a trainer: Lightning's manual backward, optimizer and clipping replaced by
    plain torch; returns the first mini-batch's metrics, the gradients at every optimizer step (after
    clipping) and the prepared context."""
    module.setup("fit")
    optimizer = module.configure_optimizers()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads_at_steps: list[list[torch.Tensor]] = []
    step = optimizer.step

    def recording_step(*args, **kwargs):
        grads_at_steps.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params])
        return step(*args, **kwargs)

    optimizer.step = recording_step
    module.optimizers = lambda: optimizer
    module.manual_backward = lambda loss: loss.backward()
    module.clip_gradients = lambda opt, gradient_clip_val, gradient_clip_algorithm: (
        torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)
    )
    context = module.prepare_batch(batch)
    first = module.update(batch, context)
    return first, grads_at_steps, context


def assert_same_step(reference, candidate) -> None:
    (first_ref, grads_ref, context_ref), (first, grads, context) = reference, candidate
    assert set(first) == set(first_ref)
    for key in first_ref:
        torch.testing.assert_close(first[key].float(), first_ref[key].float(), **TOLERANCE, msg=key)
    assert len(grads) == len(grads_ref)
    for step_ref, step in zip(grads_ref, grads):
        for g_ref, g in zip(step_ref, step):
            torch.testing.assert_close(g, g_ref, **TOLERANCE)
    for key in ("prox_logp", "ref_logp", "old_values", "advantages", "returns"):
        if isinstance(getattr(context_ref, key, None), torch.Tensor):
            mask = a_batch().response_mask[:, 1:].bool()
            ref, got = getattr(context_ref, key), getattr(context, key)
            if ref.dim() == 2:
                ref, got = ref[mask], got[mask]
            torch.testing.assert_close(got, ref, **TOLERANCE, msg=key)


# (micro_batch_rows, micro_batch_tokens) against (None, None): rows of 1, of 3 (3 + 1 in a
# mini-batch of 4), all rows of the mini-batch, a budget of one token (one row each) and of 30
SPLITS = [(1, None), (3, None), (4, None), (None, 1), (None, 30), (2, 30)]
SPLIT_IDS = ["rows1", "rows3", "rows_all", "tokens1", "tokens30", "rows2_tokens30"]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize(("rows", "tokens"), SPLITS, ids=SPLIT_IDS)
def test_grpo_micro_batches_give_the_mini_batch_loss_gradients_and_metrics(aggregation, rows, tokens):
    options = dict(
        loss_aggregation=aggregation,
        kl_coef=0.1,
        old_logprob="recompute",
        tis_cap=2.0,
        entropy_coef=0.01,
        mini_batches=2,
        max_new_tokens=MAX_NEW_TOKENS,
        lr=0.0,
    )
    reference = one_update(tiny_module(**options), a_batch())
    module = tiny_module(**options, micro_batch_rows=rows, micro_batch_tokens=tokens)
    assert_same_step(reference, one_update(module, a_batch()))


@pytest.mark.parametrize(
    ("rows", "tokens"), [(1, None), (3, None), (None, 30)], ids=["rows1", "rows3", "tokens30"]
)
def test_grpo_micro_batches_keep_the_sequence_level_and_masking_options(rows, tokens):
    """GSPO ratios with sequence-masked importance weights and truncated rows left out: the metrics
    that are means over sequences are combined by sequences."""
    options = dict(
        loss_aggregation="seq-mean-token-mean",
        ratio_level="sequence",
        clip_ratio_c=None,
        clip_low=0.05,
        clip_high=0.05,
        old_logprob="recompute",
        sequence_mask_cap=3.0,
        mask_truncated=True,
        mini_batches=2,
        max_new_tokens=MAX_NEW_TOKENS,
        lr=0.0,
    )
    reference = one_update(tiny_module(**options), a_batch())
    assert reference[0]["mismatch_masked_fraction"] >= 0
    module = tiny_module(**options, micro_batch_rows=rows, micro_batch_tokens=tokens)
    assert_same_step(reference, one_update(module, a_batch()))


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize(
    ("rows", "tokens"), [(1, None), (3, None), (4, None), (None, 30)], ids=SPLIT_IDS[:3] + ["tokens30"]
)
def test_ppo_micro_batches_give_the_mini_batch_loss_gradients_and_metrics_critic_included(
    aggregation, rows, tokens
):
    options = dict(
        loss_aggregation=aggregation, kl_coef=0.1, mini_batches=2, max_new_tokens=MAX_NEW_TOKENS, lr=0.0
    )
    reference = one_update(tiny_module(PPOModule, **options), a_batch())
    assert reference[0]["vf_loss"] > 0
    module = tiny_module(PPOModule, **options, micro_batch_rows=rows, micro_batch_tokens=tokens)
    assert_same_step(reference, one_update(module, a_batch()))


# -- Flow-GRPO: micro-batches of images ----------------------------------------------------------
@pytest.fixture(scope="module")
def flow_batch():
    from unirl_lightning.engines.diffusion import DiffusionEngineConfig
    from unirl_lightning.models.diffusion import TinyFlowModel
    from unirl_lightning.rollout.batches import DiffusionBatch
    from unirl_lightning.rollout.records import DiffusionSampling, RolloutRequest

    engine = DiffusionEngineConfig(device="cpu").build(TinyFlowModel(pretrain_steps=0))
    request = RolloutRequest(
        records=[{"prompt": ""}, {"prompt": ""}], n=3, sampling=DiffusionSampling(num_steps=3), seed=3
    )
    groups = engine.generate(request)
    for i, row in enumerate(r for g in groups for r in g):  # rewards that differ inside each group
        row.reward = float((i * 5) % 4)
    return DiffusionBatch.collate(groups)


def flow_module(**overrides) -> FlowGRPOModule:
    from unirl_lightning.models.diffusion import TinyFlowModel

    return FlowGRPOModule(
        policy=TinyFlowModel(pretrain_steps=0),
        num_generations=3,
        num_steps=3,
        kl_coef=0.1,
        mini_batches=2,
        lr=0.0,
        **overrides,
    )


def perturbed_flow_update(module, batch):
    module.setup("fit")  # the reference: the initial weights; then the policy moves off it
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.policy.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    module.setup = lambda stage: None
    return one_update(module, batch)


@pytest.fixture(scope="module")
def flow_reference(flow_batch):
    return perturbed_flow_update(flow_module(), flow_batch)


@pytest.mark.parametrize("rows", [1, 2, 3], ids=["rows1", "rows2", "rows_all"])
def test_flow_grpo_micro_batches_give_the_mini_batch_loss_gradients_and_metrics(
    flow_batch, flow_reference, rows
):
    reference = flow_reference
    assert reference[0]["kl"] > 0 and "ratio_dev_max" in reference[0]
    assert_flow_same(reference, perturbed_flow_update(flow_module(micro_batch_rows=rows), flow_batch))


def assert_flow_same(reference, candidate) -> None:
    (first_ref, grads_ref, _), (first, grads, _) = reference, candidate
    assert set(first) == set(first_ref)
    for key in first_ref:
        torch.testing.assert_close(first[key], first_ref[key], **TOLERANCE, msg=key)
    for step_ref, step in zip(grads_ref, grads, strict=True):
        for g_ref, g in zip(step_ref, step):
            torch.testing.assert_close(g, g_ref, **TOLERANCE)


# -- packing -------------------------------------------------------------------------------------
def test_rows_are_packed_within_the_token_budget_one_row_at_least():
    widths = [9, 3, 7, 3, 12, 5]
    for budget in (1, 10, 15, 24, 100):
        parts = pack_rows_by_tokens(widths, budget)
        assert sorted(i for p in parts for i in p) == list(range(len(widths)))
        for part in parts:
            assert len(part) == 1 or len(part) * max(widths[i] for i in part) <= budget
    assert pack_rows_by_tokens(widths, 1) == [[4], [0], [2], [5], [1], [3]]  # longest first
    assert pack_rows_by_tokens(widths, 24) == [[0, 4], [1, 2, 5], [3]]  # 2 x 12, 3 x 7, 1 x 3
    assert pack_rows_by_tokens(widths, 100, max_rows=4) == [[0, 2, 4, 5], [1, 3]]
    assert split_to_count([[0, 1, 2, 3], [4]], 4) == [[0], [1], [2, 3], [4]]
    assert split_to_count([[0], [1]], 5) == [[0], [1]]  # one row each: as many as there can be


def test_a_micro_batch_is_cut_to_its_longest_row():
    module = tiny_module(micro_batch_tokens=16, max_new_tokens=MAX_NEW_TOKENS)
    batch = a_batch()
    widths = row_widths(batch.attention_mask)
    assert widths.tolist() == batch.attention_mask.sum(dim=1).tolist()  # right-padded rows
    parts = module.micro_batcher.plan(batch, world=1, device="cpu")
    assert len(parts) > 1
    for rows in parts:
        micro, _ = module.micro_batcher.view(batch, TokenContext(), rows, len(parts))
        assert micro.input_ids.shape[1] == int(widths[rows].max())
        assert micro.num_rows * micro.input_ids.shape[1] <= 16 or micro.num_rows == 1


def test_micro_batch_arguments_are_checked():
    with pytest.raises(ValueError, match=r"micro_batch_tokens must be >= 1, got 0"):
        tiny_module(micro_batch_tokens=0)
    with pytest.raises(ValueError, match=r"micro_batch_rows must be >= 1, got 0"):
        tiny_module(micro_batch_rows=0)


# -- activation checkpointing -------------------------------------------------------------------
@pytest.mark.parametrize("module_cls", [GRPOModule, PPOModule])
def test_gradient_checkpointing_recomputes_the_blocks_and_gives_the_same_gradients(module_cls):
    options = dict(kl_coef=0.1, old_logprob="recompute", max_new_tokens=MAX_NEW_TOKENS, lr=0.0)
    plain = tiny_module(module_cls, **options)
    checkpointed = tiny_module(module_cls, **options, gradient_checkpointing=True)
    layer = checkpointed.policy.model.layers[0]
    assert layer.gradient_checkpointing and not plain.policy.model.layers[0].gradient_checkpointing
    if module_cls is PPOModule:
        assert checkpointed.critic.backbone.layers[0].gradient_checkpointing
    # transformers checkpoints the block's forward: a module inside it is entered again in the backward
    # (a pre-hook: the recompute stops inside the MLP once it has what the backward needs)
    calls = []
    layer.mlp.register_forward_pre_hook(lambda *args: calls.append(torch.is_grad_enabled()))
    reference = one_update(plain, a_batch())
    result = one_update(checkpointed, a_batch())
    # with gradient: the loss forward, and its recompute in the backward (the no-grad recomputes
    # of prepare_batch, the policy's and the reference copy's, run it without)
    assert calls.count(True) == 2, calls
    assert_same_step(reference, result)


# -- the global token mean over data-parallel ranks ---------------------------------------------
# rank 0 trains on the first group (long completions), rank 1 on the second (short ones)
RANK_GROUPS = [
    [(4, 5), (2, 5), (6, 4), (3, 5)],
    [(5, 1), (2, 2), (7, 1), (3, 1)],
]
DP_OPTIONS = dict(kl_coef=0.1, old_logprob="recompute", max_new_tokens=MAX_NEW_TOKENS)


def dp_grads(module, batch) -> list[torch.Tensor]:
    """The gradient of one ``backward_minibatch`` over the whole batch (no optimizer step)."""
    module.setup("fit")
    module.manual_backward = lambda loss: loss.backward()
    context = module.prepare_batch(batch)
    module.backward_minibatch(batch, context)
    return [p.grad.clone() for p in module.policy.parameters()]


DP_MICRO_BATCH_TOKENS = (None, 12)  # the whole batch; micro-batches (rank 0 packs more of them)


def _dp_rank(rank: int, store_dir: str) -> None:
    torch.set_num_threads(1)
    store = torch.distributed.FileStore(os.path.join(store_dir, "store"), 2)
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        results = []
        for micro_batch_tokens in DP_MICRO_BATCH_TOKENS:
            module = tiny_module(**DP_OPTIONS, micro_batch_tokens=micro_batch_tokens)
            module.setup("fit")  # the reference copy before the policy is wrapped
            module.policy = torch.nn.parallel.DistributedDataParallel(module.policy)
            batch = a_batch([RANK_GROUPS[rank]], first_seed=rank)
            local = module.loss_units(batch, TokenContext())
            total = global_token_count(local, device=module.device)
            packed = len(module.micro_batcher.pack(batch))
            grads = dp_grads(module, batch)
            results.append({"local": local, "total": total, "packed": packed, "grads": grads})
        torch.save(results, os.path.join(store_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_token_mean_over_two_ranks_is_the_global_token_mean():
    """Two gloo ranks (unequal token counts, DDP averaging their gradients; with micro-batches the
    ranks pack different counts and are evened out) get one rank's gradient on the union of their rows;
    the per-rank token mean DDP used to average would not. About 30 s: two fresh interpreters."""
    union = dp_grads(tiny_module(**DP_OPTIONS), a_batch(RANK_GROUPS))
    per_rank = [
        dp_grads(tiny_module(**DP_OPTIONS), a_batch([g], first_seed=r)) for r, g in enumerate(RANK_GROUPS)
    ]
    naive = [(a + b) / 2 for a, b in zip(*per_rank)]
    assert max((n - u).abs().max() for n, u in zip(naive, union)) > 1e-3, "the test tells them apart"
    with tempfile.TemporaryDirectory() as store_dir:
        mp.spawn(_dp_rank, args=(store_dir,), nprocs=2, join=True)
        ranks = [torch.load(Path(store_dir) / f"rank{r}.pt") for r in (0, 1)]
    assert ranks[0][1]["packed"] > ranks[1][1]["packed"], "the ranks pack unequal micro-batch counts"
    for variant in range(len(DP_MICRO_BATCH_TOKENS)):
        results = [rank[variant] for rank in ranks]
        locals_ = [int(r["local"]) for r in results]
        assert locals_[0] != locals_[1] and all(int(r["total"]) == sum(locals_) for r in results)
        for rank in results:
            for got, expected in zip(rank["grads"], union):
                torch.testing.assert_close(got, expected, **TOLERANCE)


def test_global_token_count_on_one_process_is_the_local_count():
    local = torch.tensor(7.0)
    total = global_token_count(local)
    assert total.dtype == torch.float64 and float(total) == 7.0 and total is not local


def test_one_rank_module_normaliser_is_its_own_token_count():
    module = tiny_module(max_new_tokens=MAX_NEW_TOKENS)
    batch = a_batch()
    assert module.data_parallel_size() == 1
    expected = batch.response_mask[:, 1:].sum()
    normalizer = MicroBatcher.normalizer(module.loss_units(batch, TokenContext()), world=1, global_mean=True)
    assert float(normalizer) == float(expected)
    copy.deepcopy(module)  # the module stays copyable (checkpointing state, new attributes)
