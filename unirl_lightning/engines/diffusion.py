"""The diffusion rollout engine: Flow-GRPO SDE sampling over a ``diffusers`` flow-matching model.

Called inside a rollout worker (a Ray actor), one call at a time, like every engine (see
:mod:`unirl_lightning.engines.base`). Guarantees:

* ``generate(request)`` returns one group per prompt record, ``request.n`` :class:`DiffusionRollout`\\ s
  each. ``request.sampling`` is a :class:`DiffusionSampling`. The initial noise and the SDE noise come
  from one ``torch.Generator`` per chunk of at most ``max_batch_size`` samples, chunk ``c`` seeded with
  :func:`~unirl_lightning.core.seeding.derive_seed` ``(request.seed, c)``, so a request with a fixed
  seed and ``eta=0`` gives the same images every time (deterministic eval).
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
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from unirl_lightning.algorithms.flow import sde_step
from unirl_lightning.core.seeding import derive_seed
from unirl_lightning.engines.base import InPlaceBucketLoading, TorchThreadsEngineConfig, engine_device
from unirl_lightning.models.diffusion import SD3FlowModel, TinyFlowModel, guided_velocity
from unirl_lightning.models.lora import LoraSpec, apply_lora, effective_weights, load_named_weights
from unirl_lightning.rollout.batches import DiffusionRollout
from unirl_lightning.rollout.records import DiffusionSampling, PolicyFamily, RolloutRequest

__all__ = ["DiffusionEngine", "DiffusionEngineConfig"]


@dataclass
class DiffusionEngineConfig(TorchThreadsEngineConfig):
    """Configuration of the diffusion engine (the policy and its LoRA spec are the module's).

    Args:
        device: ``"auto"`` = cuda if visible, else cpu.
        num_threads: torch intra-op threads in the worker: ``"auto"`` = the strategy's CPU rule, an
            int, or None = torch's default.
        max_batch_size: images per sampling call.

    Example::

        AsyncRolloutStrategy(engine=DiffusionEngineConfig(device="cpu", num_threads=1), max_inflight=1)
    """

    family: ClassVar[PolicyFamily] = "diffusion"
    device: str = "auto"
    num_threads: int | Literal["auto"] | None = "auto"
    max_batch_size: int = 64

    def build(self, policy: TinyFlowModel | SD3FlowModel, lora: LoraSpec | None = None) -> DiffusionEngine:
        return DiffusionEngine(self, policy, lora)


class DiffusionEngine(InPlaceBucketLoading):  # a streamed push is loaded bucket by bucket, in place
    """Samples image groups with the Flow-GRPO SDE; see the module docstring for the contract."""

    def __init__(
        self, config: DiffusionEngineConfig, policy: TinyFlowModel | SD3FlowModel, lora: LoraSpec | None
    ) -> None:
        self.config = config
        self.lora = lora
        self.device = engine_device(config.device, config.num_threads)
        self.pipeline = policy.build()
        if lora is not None:
            self.pipeline.denoiser = apply_lora(self.pipeline.denoiser, lora, self.pipeline.lora_targets)
        self.pipeline.to(self.device)
        self.denoiser = self.pipeline.denoiser.eval().requires_grad_(False)
        self.weight_version = 0

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> None:
        load_named_weights(self.denoiser, named_tensors, self.lora)
        self.weight_version = weight_version

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The effective denoiser weights (LoRA merged in), on CPU."""
        return effective_weights(self.denoiser)

    def sleep(self) -> None:
        if self.device.type == "cuda":
            self.pipeline.to(torch.device("cpu"))
            torch.cuda.empty_cache()

    def wake(self, tags: list[str] | None = None) -> None:
        """Move the pipeline back (``tags`` are ignored; a second call is a no-op)."""
        self.pipeline.to(self.device)

    def close(self) -> None:
        """Nothing to free beyond the pipeline, which goes with the worker."""

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
        for chunk_index, start in enumerate(range(0, len(request.records), per_call)):
            chunk = request.records[start : start + per_call]
            seed = None if request.seed is None else derive_seed(request.seed, chunk_index)
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
