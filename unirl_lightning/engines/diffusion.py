"""The diffusion rollout engine: Flow-GRPO SDE sampling over a ``diffusers`` flow-matching model.

Called inside a rollout worker (a Ray actor), one call at a time, like every engine (see
:mod:`unirl_lightning.engines.base`). Guarantees:

* ``generate(request)`` returns one group per prompt record, ``request.n`` :class:`DiffusionRollout`\\ s
  each. ``request.sampling`` is a :class:`DiffusionSampling`. The initial noise and the SDE noise come
  from one ``torch.Generator`` seeded with ``request.seed`` (plus the chunk offset), so a request with
  a fixed seed and ``eta=0`` gives the same images every time (deterministic eval).
* Steps listed by ``DiffusionSampling.sde_steps()`` run the Flow-GRPO SDE
  (:func:`~unirl_lightning.algorithms.flow.sde_step` at noise level ``eta``); the others run the
  deterministic ODE (Euler, ``eta=0``). For each SDE step a rollout records the latents before and
  after it, its sigmas and its Gaussian transition log-prob, all float32: exactly what the trainer
  needs to replay the step with :func:`guided_velocity` + ``sde_step(prev_sample=...)`` and get the
  same log-prob under the same weights.
* Rewards are left at 0; the worker scores ``rollout.reward_input`` (the ``uint8`` image).
* ``load_weights`` takes the denoiser's full parameters by name, or, when the engine runs LoRA, the
  ``peft`` adapter tensors only (``get_peft_model_state_dict`` names). ``state_dict()`` returns the
  weights the engine computes with (LoRA merged in), so tests can compare them with the trainer's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from unirl_lightning.algorithms.flow import sde_step
from unirl_lightning.engines.base import engine_device
from unirl_lightning.lora import load_named_weights
from unirl_lightning.models_diffusion import (
    FlowPipeline,
    LoraSpec,
    SD3FlowModel,
    TinyFlowModel,
    apply_lora,
    effective_weights,
)
from unirl_lightning.rollout.types import RolloutRequest

__all__ = [
    "DiffusionEngine",
    "DiffusionEngineConfig",
    "DiffusionRollout",
    "DiffusionSampling",
    "guided_velocity",
]


@dataclass(frozen=True)
class DiffusionSampling:
    """How the diffusion engine samples: ``num_steps`` denoising steps, the SDE on ``sde_indices``.

    Args:
        num_steps: denoising steps of the sampler (the scheduler's sigmas, ``1.0 -> 0.0``).
        eta: noise level of the Flow-GRPO SDE (its ``noise_level``), ``>= 0``. ``eta=0`` is the
            deterministic ODE (evaluation): no step is stochastic and nothing is recorded.
        sde_indices: the step indices (in ``[0, num_steps)``) that run the SDE and are recorded
            for training; ``None`` = every step when ``eta > 0``. A window such as ``[0, 1, 2]``
            trains on the early, high-noise steps only (Flow-GRPO-Fast, MixGRPO).
        guidance_scale: classifier-free guidance; 1.0 = off (one denoiser call per step).

    Example::

        DiffusionSampling(num_steps=10, eta=0.7, sde_indices=(0, 1, 2, 3))
    """

    num_steps: int = 10
    eta: float = 1.0
    sde_indices: tuple[int, ...] | None = None
    guidance_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if not self.eta >= 0:
            raise ValueError(f"eta must be >= 0 (0 = the deterministic ODE), got {self.eta!r}")
        if not self.guidance_scale >= 0:
            raise ValueError(f"guidance_scale must be >= 0 (1.0 = no guidance), got {self.guidance_scale!r}")
        if self.sde_indices is None:
            return
        indices = tuple(int(i) for i in self.sde_indices)
        outside = [i for i in indices if not 0 <= i < self.num_steps]
        if outside:
            raise ValueError(
                f"sde_indices {list(indices)} fall outside the schedule: {outside} not in "
                f"[0, num_steps={self.num_steps})"
            )
        if len(set(indices)) != len(indices):
            raise ValueError(f"sde_indices must not repeat a step, got {list(indices)}")
        if self.eta == 0 and indices:
            raise ValueError(
                f"eta=0 is the deterministic ODE, so no step can be an SDE step; got sde_indices={list(indices)} "
                "(give eta > 0, or sde_indices=None / [])"
            )
        object.__setattr__(self, "sde_indices", tuple(sorted(indices)))

    def sde_steps(self) -> tuple[int, ...]:
        """The step indices that run the SDE and are recorded (empty for ``eta=0``)."""
        if self.eta == 0:
            return ()
        return tuple(range(self.num_steps)) if self.sde_indices is None else self.sde_indices


@dataclass
class DiffusionRollout:
    """One sampled image with the SDE trajectory the trainer replays (``S`` recorded steps).

    ``latents[s]`` is the input of recorded step ``s`` and ``next_latents[s]`` its sampled output;
    ``log_probs[s]`` is the Gaussian log-prob of that transition (mean over latent elements).
    """

    image: np.ndarray  # uint8 [H, W, 3]
    latents: torch.Tensor  # [S, C, h, w] float32
    next_latents: torch.Tensor  # [S, C, h, w] float32
    log_probs: torch.Tensor  # [S] float32
    sigmas: torch.Tensor  # [S] float32, sigma of each recorded step
    sigmas_next: torch.Tensor  # [S] float32
    eta: float
    guidance_scale: float = 1.0
    record: dict[str, Any] = field(default_factory=dict)
    reward: float = 0.0
    prompt: str = ""
    text: str = ""  # unused by images; kept so that text-only code paths still read a string
    group_id: int = 0
    gen_id: int = -1
    weight_version: int = -1

    def __post_init__(self) -> None:
        steps = self.log_probs.shape[0]
        if self.latents.shape != self.next_latents.shape or self.latents.shape[:1] != (steps,):
            raise ValueError(
                f"a DiffusionRollout needs latents and next_latents of shape [S, ...] with S = {steps} "
                f"log-probs, got {tuple(self.latents.shape)} and {tuple(self.next_latents.shape)}"
            )
        if self.sigmas.shape != (steps,) or self.sigmas_next.shape != (steps,):
            raise ValueError(
                f"a DiffusionRollout needs one sigma per recorded step ({steps}), got "
                f"{tuple(self.sigmas.shape)} and {tuple(self.sigmas_next.shape)}"
            )

    @property
    def reward_input(self) -> np.ndarray:
        """What an image reward scores: the ``uint8`` image ``[H, W, 3]``."""
        return self.image


def _concat_cond(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: torch.cat([a[key], b[key]]) for key in a}


def guided_velocity(
    pipeline: FlowPipeline,
    denoiser: torch.nn.Module,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    cond: dict[str, torch.Tensor],
    null_cond: dict[str, torch.Tensor] | None,
    guidance_scale: float,
) -> torch.Tensor:
    """The velocity the sampler steps with: ``v_null + g (v_cond - v_null)`` under guidance, else ``v_cond``.

    Both the engine (sampling) and the trainer (replay) call this, so they compute alike.
    """
    if guidance_scale == 1.0 or null_cond is None:
        return pipeline.velocity(denoiser, latents, sigma, cond)
    both = pipeline.velocity(
        denoiser, torch.cat([latents, latents]), torch.cat([sigma, sigma]), _concat_cond(null_cond, cond)
    )
    v_null, v_cond = both.chunk(2)
    return v_null + guidance_scale * (v_cond - v_null)


@dataclass
class DiffusionEngineConfig:
    """Configuration of the diffusion engine.

    Example::

        DiffusionEngineConfig(device="cpu", num_threads=1)  # policy and lora: the module's
    """

    policy: TinyFlowModel | SD3FlowModel | None = None  # None = the module's policy
    lora: LoraSpec | None = None  # filled in by the module; must match the trainer's
    device: str = "auto"  # "auto" = cuda if visible, else cpu
    num_threads: int | None = 1  # torch intra-op threads in the worker (None = torch's default)
    max_batch_size: int = 64  # images per sampling call

    def build(self) -> DiffusionEngine:
        if self.policy is None:
            raise ValueError(
                "DiffusionEngineConfig.policy is None: give a policy spec, or let the module fill it in"
            )
        return DiffusionEngine(self)


class DiffusionEngine:
    """Samples image groups with the Flow-GRPO SDE; see the module docstring for the contract."""

    def __init__(self, config: DiffusionEngineConfig) -> None:
        self.config = config
        self.device = engine_device(config.device, config.num_threads)
        self.pipeline = config.policy.build()
        if config.lora is not None:
            self.pipeline.denoiser = apply_lora(self.pipeline.denoiser, config.lora, self.pipeline.arch)
        self.pipeline.to(self.device)
        self.denoiser = self.pipeline.denoiser.eval().requires_grad_(False)
        self.weight_version = 0

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> None:
        load_named_weights(self.denoiser, named_tensors, self.config.lora)
        self.weight_version = weight_version

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The effective denoiser weights (LoRA merged in), on CPU."""
        return effective_weights(self.denoiser)

    def sleep(self) -> None:
        if self.device.type == "cuda":
            self.pipeline.to(torch.device("cpu"))
            torch.cuda.empty_cache()

    def wake(self) -> None:
        self.pipeline.to(self.device)

    # -- sampling --------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, request: RolloutRequest) -> list[list[DiffusionRollout]]:
        sampling = request.sampling
        if not isinstance(sampling, DiffusionSampling):
            raise TypeError(
                f"the diffusion engine needs request.sampling to be a DiffusionSampling, got {type(sampling).__name__}"
            )
        if sampling.guidance_scale != 1.0 and not self.pipeline.conditional:
            raise ValueError(
                f"guidance_scale={sampling.guidance_scale} needs a conditional model; this one is "
                "unconditional (use guidance_scale=1.0)"
            )
        groups: list[list[DiffusionRollout]] = []
        per_call = max(1, self.config.max_batch_size // request.n)
        for start in range(0, len(request.records), per_call):
            chunk = request.records[start : start + per_call]
            seed = None if request.seed is None else request.seed + start
            groups.extend(self._generate_chunk(chunk, request.n, sampling, seed, group_offset=start))
        return groups

    def _generate_chunk(
        self,
        records: list[dict[str, Any]],
        n: int,
        sampling: DiffusionSampling,
        seed: int | None,
        group_offset: int,
    ) -> list[list[DiffusionRollout]]:
        device, pipeline = self.device, self.pipeline
        batch = len(records) * n
        generator = torch.Generator(device=device)
        if seed is None:
            generator.seed()  # non-deterministic
        else:
            generator.manual_seed(seed)
        cond = {key: value.repeat_interleave(n, 0) for key, value in pipeline.encode(records, device).items()}
        null_cond = pipeline.encode_null(batch, device) if sampling.guidance_scale != 1.0 else None
        latents = torch.randn((batch, *pipeline.latent_shape), generator=generator, device=device)
        sigmas = pipeline.sigmas(sampling.num_steps)
        recorded = set(sampling.sde_steps())
        inputs, outputs, log_probs, sigma_list, sigma_next_list = [], [], [], [], []
        for step in range(sampling.num_steps):
            sigma = torch.full((batch,), sigmas[step], device=device)
            sigma_next = torch.full((batch,), sigmas[step + 1], device=device)
            velocity = guided_velocity(
                pipeline, self.denoiser, latents, sigma, cond, null_cond, sampling.guidance_scale
            )
            eta = sampling.eta if step in recorded else 0.0
            next_latents, log_prob, _, _ = sde_step(
                velocity, latents, sigma, sigma_next, eta, generator=generator
            )
            if step in recorded:
                inputs.append(latents)
                outputs.append(next_latents)
                log_probs.append(log_prob)
                sigma_list.append(sigmas[step])
                sigma_next_list.append(sigmas[step + 1])
            latents = next_latents
        images = pipeline.decode(latents).numpy()
        steps = len(inputs)
        shape = pipeline.latent_shape
        # [B, S, ...] on CPU; every rollout gets its own copy (a pickled view would ship the whole batch)
        traj_in = torch.stack(inputs, 1).cpu() if steps else torch.zeros(batch, 0, *shape)
        traj_out = torch.stack(outputs, 1).cpu() if steps else torch.zeros(batch, 0, *shape)
        traj_logp = torch.stack(log_probs, 1).cpu() if steps else torch.zeros(batch, 0)
        sigma_t = torch.tensor(sigma_list, dtype=torch.float32)
        sigma_next_t = torch.tensor(sigma_next_list, dtype=torch.float32)
        groups: list[list[DiffusionRollout]] = []
        for i, record in enumerate(records):
            group = []
            for j in range(n):
                row = i * n + j
                group.append(
                    DiffusionRollout(
                        image=images[row].copy(),
                        latents=traj_in[row].clone(),
                        next_latents=traj_out[row].clone(),
                        log_probs=traj_logp[row].clone(),
                        sigmas=sigma_t.clone(),
                        sigmas_next=sigma_next_t.clone(),
                        eta=float(sampling.eta),
                        guidance_scale=float(sampling.guidance_scale),
                        record=dict(record),
                        prompt=str(record.get("prompt", "")),
                        group_id=group_offset + i,
                        weight_version=self.weight_version,
                    )
                )
            groups.append(group)
        return groups
