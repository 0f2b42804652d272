"""Pins unirl_lightning.engines.diffusion (in-process, no Ray): the sampling contract, the recorded SDE
window, exact replay of the recorded log-probs, seeded determinism, guidance, weight loading, the worker's
scoring of images, and DiffusionBatch collation."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from unirl_lightning.algorithms import sde_step
from unirl_lightning.engines.diffusion import DiffusionEngineConfig
from unirl_lightning.models.diffusion import TinyFlowModel, guided_velocity
from unirl_lightning.models.lora import LoraSpec
from unirl_lightning.modules import FlowGRPOModule
from unirl_lightning.rewards import RewardError
from unirl_lightning.rewards.image import CallableImageReward, TargetColorReward
from unirl_lightning.rollout.batches import DiffusionBatch
from unirl_lightning.rollout.records import DiffusionSampling, RolloutRequest
from unirl_lightning.workers.actor import RolloutWorker

RANDOM_TINY = TinyFlowModel(pretrain_steps=0)  # random init: these tests pin mechanics, not image quality


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return DiffusionEngineConfig(device="cpu").build(RANDOM_TINY)


def request(records, n=3, seed=7, **sampling):
    return RolloutRequest(records=records, n=n, sampling=DiffusionSampling(**sampling), seed=seed)


# -- bad inputs ------------------------------------------------------------------------------------
def test_an_sde_window_outside_the_schedule_is_refused_naming_the_value():
    with pytest.raises(
        ValueError, match=r"sde_indices \[2, 7\] fall outside the schedule: \[7\] not in \[0, num_steps=4\)"
    ):
        DiffusionSampling(num_steps=4, sde_indices=(2, 7))
    with pytest.raises(ValueError, match=r"\[-1\] not in \[0, num_steps=10\)"):
        FlowGRPOModule(policy=RANDOM_TINY, sde_indices=[-1, 0])
    with pytest.raises(ValueError, match=r"must not repeat a step, got \[1, 1\]"):
        DiffusionSampling(num_steps=4, sde_indices=(1, 1))


def test_negative_eta_is_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"eta must be >= 0 \(0 = the deterministic ODE\), got -0\.1"):
        DiffusionSampling(eta=-0.1)
    with pytest.raises(ValueError, match=r"eta must be >= 0 .*got -0\.5"):
        FlowGRPOModule(policy=RANDOM_TINY, eta=-0.5)
    with pytest.raises(ValueError, match=r"eta=0 is the deterministic ODE.*sde_indices=\[0\]"):
        DiffusionSampling(eta=0.0, sde_indices=(0,))
    with pytest.raises(ValueError, match=r"training needs at least one SDE step.*eta=0\.0"):
        FlowGRPOModule(policy=RANDOM_TINY, eta=0.0)


def test_guidance_needs_a_conditional_model_and_labels_are_checked(engine):
    with pytest.raises(ValueError, match=r"guidance_scale=3\.0 needs a conditional model"):
        engine.generate(request([{"prompt": ""}], guidance_scale=3.0))
    conditional = DiffusionEngineConfig(device="cpu").build(TinyFlowModel(num_classes=2, pretrain_steps=0))
    with pytest.raises(ValueError, match=r"'label' to be an int in \[0, 2\), got 5"):
        conditional.generate(request([{"prompt": "x", "label": 5}]))


# -- sampling --------------------------------------------------------------------------------------
def test_the_sde_window_is_recorded_and_replaying_it_gives_the_recorded_log_probs(engine):
    groups = engine.generate(
        request([{"prompt": "a"}, {"prompt": "b"}], n=3, num_steps=4, sde_indices=(1, 2))
    )
    assert [len(g) for g in groups] == [3, 3]
    sigmas = engine.pipeline.sigmas(4)
    rows = [r for g in groups for r in g]
    for r in rows:
        assert r.image.shape == (8, 8, 3) and r.image.dtype == np.uint8
        assert r.latents.shape == (2, 3, 8, 8) and r.log_probs.shape == (2,)
        assert r.sigmas.tolist() == pytest.approx(sigmas[1:3]) and r.sigmas_next.tolist() == pytest.approx(
            sigmas[2:4]
        )
        assert torch.equal(r.next_latents[0], r.latents[1])  # a contiguous window chains
    batch = DiffusionBatch.collate(groups)
    cond = engine.pipeline.encode(batch.records, torch.device("cpu"))
    with torch.no_grad():
        for step in range(2):
            velocity = guided_velocity(
                engine.pipeline,
                engine.denoiser,
                batch.latents[:, step],
                batch.sigmas[:, step],
                cond,
                None,
                1.0,
            )
            _, logp, _, _ = sde_step(
                velocity,
                batch.latents[:, step],
                batch.sigmas[:, step],
                batch.sigmas_next[:, step],
                batch.eta,
                prev_sample=batch.next_latents[:, step],
            )
            torch.testing.assert_close(logp, batch.log_probs[:, step], rtol=0, atol=1e-6)


def test_a_fixed_seed_gives_the_same_images_and_eta_0_is_a_deterministic_ode(engine):
    ode = dict(num_steps=4, eta=0.0)
    first = engine.generate(request([{"prompt": ""}], seed=3, **ode))[0]
    again = engine.generate(request([{"prompt": ""}], seed=3, **ode))[0]
    other = engine.generate(request([{"prompt": ""}], seed=4, **ode))[0]
    assert all(np.array_equal(a.image, b.image) for a, b in zip(first, again))
    assert not np.array_equal(first[0].image, other[0].image)
    assert first[0].latents.shape[0] == 0, "the ODE records no SDE step"
    sde = [engine.generate(request([{"prompt": ""}], seed=3, num_steps=4, eta=1.0))[0] for _ in range(2)]
    assert all(torch.equal(a.next_latents, b.next_latents) for a, b in zip(*sde))


def test_classifier_free_guidance_extrapolates_from_the_null_condition():
    pipeline = TinyFlowModel(arch="unet", num_classes=2, pretrain_steps=0).build()
    latents, sigma = torch.randn(2, 3, 8, 8), torch.tensor([0.7, 0.7])
    cond = pipeline.encode([{"label": 0}, {"label": 1}], torch.device("cpu"))
    null = pipeline.encode_null(2, torch.device("cpu"))
    with torch.no_grad():
        guided = guided_velocity(pipeline, pipeline.denoiser, latents, sigma, cond, null, 3.0)
        v_cond = pipeline.velocity(pipeline.denoiser, latents, sigma, cond)
        v_null = pipeline.velocity(pipeline.denoiser, latents, sigma, null)
    torch.testing.assert_close(guided, v_null + 3.0 * (v_cond - v_null), rtol=1e-5, atol=1e-5)


# -- weights ---------------------------------------------------------------------------------------
def test_load_weights_takes_full_weights_or_adapters_by_name_and_refuses_foreign_names(engine):
    state = {k: v + 0.01 for k, v in engine.denoiser.state_dict().items()}
    engine.load_weights(state.items(), weight_version=3)
    assert engine.weight_version == 3
    assert all(torch.equal(engine.state_dict()[k], v) for k, v in state.items())
    with pytest.raises(KeyError, match="'not.a.weight' is not a parameter"):
        engine.load_weights([("not.a.weight", torch.zeros(1))], 4)
    lora = DiffusionEngineConfig(device="cpu").build(RANDOM_TINY, LoraSpec(rank=2))
    with pytest.raises(KeyError, match="takes adapter tensors only"):
        lora.load_weights(state.items(), 1)


# -- the worker scores images ----------------------------------------------------------------------
def bad_shape(images, records):
    return np.zeros((len(images), 1, 2))


def test_the_worker_scores_each_rollouts_image_and_a_bad_reward_shape_fails_naming_it():
    config = DiffusionEngineConfig(device="cpu")
    reward = TargetColorReward((0.0, 1.0, 0.0))
    result = RolloutWorker(config, RANDOM_TINY, None, reward).generate(
        request([{"prompt": ""}], n=4, num_steps=3)
    )
    group = result.groups[0]
    assert [r.reward for r in group] == pytest.approx(reward([r.image for r in group], [{}] * 4))
    with pytest.raises(
        RewardError, match=r"'bad_shape' returned .* of shape \(4, 1, 2\); expected shape \(4,\)"
    ):
        RolloutWorker(config, RANDOM_TINY, None, CallableImageReward(bad_shape)).generate(
            request([{"prompt": ""}], n=4, num_steps=3)
        )


# -- the batch -------------------------------------------------------------------------------------
def test_collate_stacks_groups_in_order_and_refuses_mixed_windows(engine):
    groups = engine.generate(request([{"prompt": "a"}, {"prompt": "b"}], n=2, num_steps=3))
    for i, rollout in enumerate(r for g in groups for r in g):
        rollout.reward, rollout.weight_version, rollout.gen_id = float(i), 5, 9
    batch = DiffusionBatch.collate(groups)
    assert batch.num_rows == 4 and batch.group_size == 2 and batch.latents.shape == (4, 3, 3, 8, 8)
    assert batch.rewards.tolist() == [0, 1, 2, 3] and batch.weight_versions.tolist() == [5] * 4
    assert [r["prompt"] for r in batch.records] == ["a", "a", "b", "b"]
    picked = batch.select(torch.tensor([1, 2]))
    assert picked.rewards.tolist() == [1, 2] and [r["prompt"] for r in picked.records] == ["a", "b"]
    window = engine.generate(request([{"prompt": "c"}], n=2, num_steps=3, sde_indices=(0,)))
    with pytest.raises(ValueError, match="must record the same SDE steps"):
        DiffusionBatch.collate(groups + window)
    with pytest.raises(ValueError, match=r"same size.*got sizes \[1, 2\]"):
        DiffusionBatch.collate([groups[0], groups[1][:1]])


# -- the module's replay: KL to the reference ------------------------------------------------------
@pytest.mark.parametrize("lora", [None, LoraSpec(rank=2)], ids=["full", "lora"])
def test_kl_to_the_reference_is_zero_at_the_start_and_grows_when_the_policy_moves(engine, lora):
    module = FlowGRPOModule(policy=RANDOM_TINY, lora=lora, num_generations=2, num_steps=3, kl_coef=0.1)
    if lora is None:  # what setup() does for full fine-tuning: a frozen copy of the initial weights
        module.ref_policy = copy.deepcopy(module.policy).requires_grad_(False)
    groups = engine.generate(request([{"prompt": ""}], n=2, num_steps=3))
    batch = DiffusionBatch.collate(groups)
    context = replace(module.prepare_batch(batch), advantages=torch.tensor([1.0, -1.0]))
    _, metrics = module.replay_step(batch, 0, context)
    assert metrics["kl"] < 1e-12
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.policy.parameters():
            if param.requires_grad:
                param.add_(0.2 * torch.randn(param.shape, generator=generator))
    loss, metrics = module.replay_step(batch, 0, context)
    assert metrics["kl"] > 1e-6 and loss.requires_grad
