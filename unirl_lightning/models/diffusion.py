"""Flow-matching policies for Flow-GRPO: picklable specs that build a :class:`FlowPipeline` in any process.

Contract. The trainer (``FlowGRPOModule``) and every diffusion rollout engine build the same
pipeline from the same spec; weights then flow trainer -> engines through ``weight_sync`` (the
whole denoiser, or its LoRA adapter only). A :class:`FlowPipeline` is what both sides need from a
rectified-flow model, with the conventions of :mod:`unirl_lightning.algorithms.flow`
(``x_sigma = (1 - sigma) x0 + sigma noise``, the denoiser predicts ``v = noise - x0``):

* ``denoiser``: the ``torch.nn.Module`` that is trained (a ``diffusers`` ``UNet2DModel`` or
  ``SD3Transformer2DModel``), wrapped by :func:`unirl_lightning.models.lora.apply_lora` with the
  pipeline's ``lora_targets`` when LoRA is on;
* ``sigmas(num_steps)``: the ``num_steps + 1`` noise levels of the sampler, from the model's
  ``FlowMatchEulerDiscreteScheduler`` (``1.0 ... 0.0``);
* ``encode(records)`` / ``encode_null(n)``: the conditioning of each prompt record, and the
  unconditional one for classifier-free guidance;
* ``velocity(denoiser, latents, sigma, cond)``: one denoiser call (``sigma`` is ``[B]``);
* ``decode(latents)``: ``uint8`` images ``[B, H, W, 3]``;
* :func:`guided_velocity`: the (classifier-free guided) velocity the sampler steps with and the
  trainer replays.

Two specs:

* :class:`TinyFlowModel` builds a tiny pixel-space model (8x8 RGB by default, random init, no
  download) and pre-trains it briefly in-process with flow matching on images of random solid
  colours, caching the result under ``cache_dir`` so that the trainer and the workers start from
  the same weights (LoRA adapter-only sync relies on identical base weights: on a multi-node
  cluster put ``cache_dir`` on shared storage). Tests and the CPU demo use it.
* :class:`SD3FlowModel` loads a Stable Diffusion 3(.5) pipeline from a hub id or local path
  (GPU recipes; never run on CPU here).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

ARCHS = ("unet", "sd3")
NUM_TRAIN_TIMESTEPS = 1000
DEFAULT_LORA_TARGETS = {
    "unet": ("conv1", "conv2", "time_emb_proj"),
    "sd3": (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
    ),
}


# -- what the engine and the module use ------------------------------------------------------------
class FlowPipeline:
    """A flow-matching model as the sampler and the trainer see it (see the module docstring)."""

    denoiser: torch.nn.Module
    latent_shape: tuple[int, int, int]
    conditional: bool = False
    arch: str = "unet"

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """The denoiser modules LoRA adapts by default for this architecture."""
        return DEFAULT_LORA_TARGETS[self.arch]

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def sigmas(self, num_steps: int) -> list[float]:
        """The sampler's ``num_steps + 1`` noise levels, from 1.0 down to 0.0 (float32 values)."""
        scheduler = copy.deepcopy(self.scheduler)
        scheduler.set_timesteps(num_steps)
        return [float(s) for s in scheduler.sigmas.float()]

    def encode(self, records: list[dict[str, Any]], device: torch.device) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def encode_null(self, batch_size: int, device: torch.device) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def velocity(
        self, denoiser: torch.nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: dict[str, Any]
    ) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def to(self, device: torch.device) -> FlowPipeline:
        self.denoiser.to(device)
        return self


def _pixels_to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """``[B, 3, H, W]`` in ``[-1, 1]`` -> ``uint8`` ``[B, H, W, 3]``."""
    return ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


class TinyFlowPipeline(FlowPipeline):
    """Pixel-space tiny model: the latents are the image in ``[-1, 1]``; optional class labels.

    Conditioning is the record's ``label`` (an int in ``[0, num_classes)``) when ``num_classes > 0``,
    with the extra label ``num_classes`` as the null condition of classifier-free guidance; the SD3
    transformer gets a constant (zero) text embedding plus the label through its pooled projection.
    """

    def __init__(self, spec: TinyFlowModel, denoiser: torch.nn.Module, scheduler: Any) -> None:
        super().__init__(scheduler)
        self.spec = spec
        self.arch = spec.arch
        self.denoiser = denoiser
        self.latent_shape = (3, spec.image_size, spec.image_size)
        self.conditional = spec.num_classes > 0

    def _labels(self, labels: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
        return {"labels": labels.to(device)}

    def encode(self, records: list[dict[str, Any]], device: torch.device) -> dict[str, torch.Tensor]:
        if not self.conditional:
            return self.encode_null(len(records), device)
        labels = []
        for record in records:
            label = record.get("label")
            if not isinstance(label, int) or not 0 <= label < self.spec.num_classes:
                raise ValueError(
                    f"TinyFlowModel(num_classes={self.spec.num_classes}) needs each record's 'label' to be an "
                    f"int in [0, {self.spec.num_classes}), got {label!r} in record {record!r}"
                )
            labels.append(label)
        return self._labels(torch.tensor(labels, dtype=torch.long), device)

    def encode_null(self, batch_size: int, device: torch.device) -> dict[str, torch.Tensor]:
        return self._labels(torch.full((batch_size,), self.spec.num_classes, dtype=torch.long), device)

    def velocity(
        self, denoiser: torch.nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: dict[str, Any]
    ) -> torch.Tensor:
        timestep = sigma * NUM_TRAIN_TIMESTEPS
        labels = cond["labels"]
        if self.arch == "unet":
            class_labels = labels if self.conditional else None
            return denoiser(latents, timestep, class_labels=class_labels).sample
        batch = latents.shape[0]
        spec = self.spec
        text = torch.zeros(batch, 1, spec.joint_attention_dim, device=latents.device, dtype=latents.dtype)
        pooled = torch.nn.functional.one_hot(labels, spec.pooled_projection_dim).to(latents.dtype)
        return denoiser(
            hidden_states=latents,
            encoder_hidden_states=text,
            pooled_projections=pooled,
            timestep=timestep,
            return_dict=False,
        )[0]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return _pixels_to_uint8(latents)


@dataclass
class TinyFlowModel:
    """A tiny pixel-space flow-matching model, random init, pre-trained briefly in-process.

    Pre-training: ``pretrain_steps`` Adam steps of flow matching (``sigma ~ U(0, 1)``, target
    ``noise - x0``) on ``image_size`` x ``image_size`` RGB images of one solid colour each, drawn
    uniformly (``num_classes = 0``) or, with ``num_classes > 0``, around ``num_classes`` fixed palette
    colours with the palette index as the label (10% of labels dropped, for classifier-free
    guidance). The result is cached in ``cache_dir`` (default: a folder under the system temp
    dir), keyed by every field below, and reused by every process that builds the same spec.

    Example::

        pipeline = TinyFlowModel(arch="sd3", image_size=8, pretrain_steps=300).build()
        images = pipeline.decode(torch.zeros(1, 3, 8, 8))  # uint8 [1, 8, 8, 3]
    """

    arch: str = "sd3"  # "sd3" (SD3Transformer2DModel, an MMDiT like SD3.5) or "unet" (UNet2DModel)
    image_size: int = 8
    channels: tuple[int, ...] = (16, 32)
    num_classes: int = 0
    num_layers: int = 2  # sd3 only
    joint_attention_dim: int = 32  # sd3 only
    pooled_projection_dim: int = 16  # sd3 only; must exceed num_classes
    pretrain_steps: int = 300
    pretrain_batch_size: int = 64
    pretrain_lr: float = 2e-3
    seed: int = 0
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"TinyFlowModel arch must be one of {ARCHS}, got {self.arch!r}")
        if self.image_size < 4 or self.image_size % 4:
            raise ValueError(
                f"TinyFlowModel image_size must be a multiple of 4 (>= 4), got {self.image_size}"
            )
        if self.num_classes < 0:
            raise ValueError(f"TinyFlowModel num_classes must be >= 0, got {self.num_classes}")
        if self.pretrain_steps < 0:
            raise ValueError(f"TinyFlowModel pretrain_steps must be >= 0, got {self.pretrain_steps}")
        if self.arch == "sd3" and self.pooled_projection_dim <= self.num_classes:
            raise ValueError(
                f"TinyFlowModel(arch='sd3') needs pooled_projection_dim > num_classes (the label is one-hot), "
                f"got pooled_projection_dim={self.pooled_projection_dim}, num_classes={self.num_classes}"
            )
        self.channels = tuple(self.channels)

    # -- building ---------------------------------------------------------------------------------
    def _denoiser(self) -> torch.nn.Module:
        if self.arch == "unet":
            from diffusers import UNet2DModel

            levels = len(self.channels)
            return UNet2DModel(
                sample_size=self.image_size,
                in_channels=3,
                out_channels=3,
                layers_per_block=1,
                block_out_channels=self.channels,
                down_block_types=("DownBlock2D",) * levels,
                up_block_types=("UpBlock2D",) * levels,
                norm_num_groups=min(8, self.channels[0]),
                add_attention=False,
                num_class_embeds=self.num_classes + 1 if self.num_classes else None,
            )
        from diffusers import SD3Transformer2DModel

        width = self.channels[-1]
        return SD3Transformer2DModel(
            sample_size=self.image_size,
            patch_size=2,
            in_channels=3,
            out_channels=3,
            num_layers=self.num_layers,
            attention_head_dim=width // 2,
            num_attention_heads=2,
            joint_attention_dim=self.joint_attention_dim,
            caption_projection_dim=width,
            pooled_projection_dim=self.pooled_projection_dim,
            pos_embed_max_size=self.image_size,
        )

    def cache_path(self) -> str:
        fields = {k: v for k, v in asdict(self).items() if k != "cache_dir"}
        key = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
        folder = self.cache_dir or os.path.join(tempfile.gettempdir(), "unirl_lightning", "tiny_flow")
        return os.path.join(os.path.expanduser(folder), f"tiny_flow_{self.arch}_{key}.pt")

    def build(self) -> TinyFlowPipeline:
        from diffusers import FlowMatchEulerDiscreteScheduler

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            denoiser = self._denoiser().float()
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=NUM_TRAIN_TIMESTEPS, shift=1.0)
        pipeline = TinyFlowPipeline(self, denoiser, scheduler)
        if self.pretrain_steps == 0:
            return pipeline
        path = self.cache_path()
        if os.path.exists(path):
            denoiser.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            return pipeline
        losses = pretrain_flow_matching(pipeline, self)
        log.info(
            "pre-trained %s: flow-matching loss %.4f -> %.4f", type(self).__name__, losses[0], losses[-1]
        )
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        torch.save(denoiser.state_dict(), tmp)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old state or the whole new one
        return pipeline

    def palette(self) -> torch.Tensor:
        """The ``[num_classes, 3]`` class colours in ``[0, 1]`` (fixed by ``seed``)."""
        generator = torch.Generator().manual_seed(self.seed + 1)
        return torch.rand(self.num_classes, 3, generator=generator)

    def solid_colours(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of pre-training images ``[B, 3, H, W]`` in ``[-1, 1]`` and their labels ``[B]``."""
        if self.num_classes:
            labels = torch.randint(self.num_classes, (batch_size,), generator=generator)
            colours = self.palette()[labels] + 0.08 * torch.randn(batch_size, 3, generator=generator)
            dropped = torch.rand(batch_size, generator=generator) < 0.1
            labels = torch.where(dropped, torch.full_like(labels, self.num_classes), labels)
        else:
            labels = torch.zeros(batch_size, dtype=torch.long)
            colours = torch.rand(batch_size, 3, generator=generator)
        pixels = (colours.clamp(0, 1) * 2 - 1)[:, :, None, None].expand(
            -1, -1, self.image_size, self.image_size
        )
        return pixels.contiguous(), labels


def pretrain_flow_matching(pipeline: TinyFlowPipeline, spec: TinyFlowModel) -> list[float]:
    """Flow matching on solid colours (see :class:`TinyFlowModel`); returns the loss of every step."""
    denoiser = pipeline.denoiser
    denoiser.train()
    generator = torch.Generator().manual_seed(spec.seed + 2)
    optimizer = torch.optim.Adam(denoiser.parameters(), lr=spec.pretrain_lr)
    losses = []
    for _ in range(spec.pretrain_steps):
        x0, labels = spec.solid_colours(spec.pretrain_batch_size, generator)
        noise = torch.randn(x0.shape, generator=generator)
        sigma = torch.rand(x0.shape[0], generator=generator)
        x_sigma = (1 - sigma)[:, None, None, None] * x0 + sigma[:, None, None, None] * noise
        cond = {"labels": labels}
        loss = torch.nn.functional.mse_loss(pipeline.velocity(denoiser, x_sigma, sigma, cond), noise - x0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    denoiser.eval()
    return losses


# -- Stable Diffusion 3(.5) ------------------------------------------------------------------------
class SD3Pipeline(FlowPipeline):
    """A ``diffusers`` ``StableDiffusion3Pipeline``: text conditioning, VAE latents, the MMDiT denoiser."""

    conditional = True
    arch = "sd3"

    def __init__(self, spec: SD3FlowModel, pipe: Any) -> None:
        super().__init__(pipe.scheduler)
        self.spec = spec
        self.pipe = pipe
        self.denoiser = pipe.transformer
        size = spec.resolution // pipe.vae_scale_factor
        self.latent_shape = (pipe.transformer.config.in_channels, size, size)

    def to(self, device: torch.device) -> SD3Pipeline:
        self.pipe.to(device)
        return self

    @torch.no_grad()
    def _embed(self, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        prompt_embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.spec.max_sequence_length,
        )
        return {"prompt_embeds": prompt_embeds, "pooled": pooled}

    def encode(self, records: list[dict[str, Any]], device: torch.device) -> dict[str, torch.Tensor]:
        return self._embed([str(r["prompt"]) for r in records], device)

    def encode_null(self, batch_size: int, device: torch.device) -> dict[str, torch.Tensor]:
        return self._embed([""] * batch_size, device)

    def velocity(
        self, denoiser: torch.nn.Module, latents: torch.Tensor, sigma: torch.Tensor, cond: dict[str, Any]
    ) -> torch.Tensor:
        dtype = self.pipe.transformer.dtype
        out = denoiser(
            hidden_states=latents.to(dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(dtype),
            pooled_projections=cond["pooled"].to(dtype),
            timestep=sigma * NUM_TRAIN_TIMESTEPS,
            return_dict=False,
        )[0]
        return out.float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        return _pixels_to_uint8(vae.decode(latents.to(vae.dtype), return_dict=False)[0])


@dataclass
class SD3FlowModel:
    """Stable Diffusion 3 / 3.5 from a hub id or local path (``StableDiffusion3Pipeline.from_pretrained``).

    The transformer is the denoiser (train it with LoRA); the text encoders and the VAE are frozen.

    Example::

        SD3FlowModel("stabilityai/stable-diffusion-3.5-medium", dtype="bfloat16", resolution=512)
    """

    path: str = "stabilityai/stable-diffusion-3.5-medium"
    dtype: str = "bfloat16"
    resolution: int = 512
    max_sequence_length: int = 128

    def build(self) -> SD3Pipeline:
        from diffusers import StableDiffusion3Pipeline

        pipe = StableDiffusion3Pipeline.from_pretrained(self.path, torch_dtype=getattr(torch, self.dtype))
        for part in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
            if part is not None:
                part.requires_grad_(False)
        pipe.set_progress_bar_config(disable=True)
        return SD3Pipeline(self, pipe)


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
