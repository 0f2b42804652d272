"""Image rewards for diffusion policies (Flow-GRPO, DDPO).

Contract: the same as every reward (:mod:`unirl_lightning.rewards.base`): a picklable object with a
``name`` and ``__call__(completions, records) -> list[float]``, called through ``score_batch``. For
images the "completions" are the rollouts' ``reward_input``: ``uint8`` arrays ``[H, W, 3]`` (numpy or
torch, or PIL images). :class:`ImageReward` stacks them into one ``uint8`` array ``[B, H, W, 3]``,
calls :meth:`ImageReward.score_images` and checks that it returned exactly one finite number per
image: anything else (a ``[B, 1]`` or ``[B, 3]`` array, a scalar, a list of the wrong length) raises
``ValueError`` naming the reward, the value and its shape (``score_batch`` wraps it in
``RewardError``).

Rule rewards run anywhere (tests, the CPU demo): :class:`JpegCompressibilityReward`,
:class:`JpegIncompressibilityReward` (DDPO), :class:`BrightnessReward`, :class:`TargetColorReward`;
:class:`CallableImageReward` wraps any function. Model-based rewards (:class:`PickScoreReward`,
:class:`ClipScoreReward`, :class:`AestheticReward`) load a model from a path the user gives, lazily,
inside the worker that first scores with them (they pickle as their paths).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from unirl_lightning.rewards.base import Reward, _import_callable

__all__ = [
    "AestheticReward",
    "BrightnessReward",
    "CallableImageReward",
    "ClipScoreReward",
    "ImageReward",
    "JpegCompressibilityReward",
    "JpegIncompressibilityReward",
    "PickScoreReward",
    "TargetColorReward",
    "to_uint8_images",
]


def to_uint8_images(images: Sequence[Any]) -> np.ndarray:
    """Stack images (``uint8`` ``[H, W, 3]`` numpy/torch arrays or PIL images) into ``uint8`` ``[B, H, W, 3]``."""
    arrays = []
    for index, image in enumerate(images):
        if hasattr(image, "detach"):  # a torch tensor
            image = image.detach().cpu().numpy()
        array = np.asarray(image)
        if array.ndim != 3 or array.shape[-1] != 3 or array.dtype != np.uint8:
            raise ValueError(
                f"image {index} must be uint8 [H, W, 3], got dtype {array.dtype} and shape {array.shape}"
            )
        arrays.append(array)
    if not arrays:
        return np.zeros((0, 0, 0, 3), dtype=np.uint8)
    return np.stack(arrays)


class ImageReward(Reward):
    """Base of the image rewards: subclasses implement ``score_images(images, records) -> [B]``."""

    name = "image_reward"

    def __call__(self, completions: list[Any], records: list[dict]) -> list[float]:
        images = to_uint8_images(completions)
        scores = self.score_images(images, records)
        return check_image_scores(self.name, scores, len(images))

    def score_images(self, images: np.ndarray, records: list[dict]) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement score_images()")


def _preview(value: Any, limit: int = 200) -> str:
    text = " ".join(repr(value).split())  # one line, whatever the array's repr
    return text if len(text) <= limit else text[:limit] + "..."


def check_image_scores(name: str, scores: Any, num_images: int) -> list[float]:
    """One finite float per image, or ``ValueError`` naming the value and its shape."""
    if hasattr(scores, "detach"):
        scores = scores.detach().float().cpu().numpy()
    try:
        array = np.asarray(scores, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"image reward {name!r} returned {_preview(scores)}, which is not numeric; expected {num_images} floats"
        ) from err
    if array.shape != (num_images,):
        raise ValueError(
            f"image reward {name!r} returned {_preview(scores)} of shape {array.shape}; expected shape "
            f"({num_images},): one score per image"
        )
    if not np.isfinite(array).all():
        raise ValueError(f"image reward {name!r} returned {_preview(scores)}; every score must be finite")
    return array.tolist()


def jpeg_size_kb(image: np.ndarray, quality: int = 95) -> float:
    """Size of ``image`` (``uint8`` ``[H, W, 3]``) encoded as JPEG, in kilobytes (DDPO)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000.0


class JpegCompressibilityReward(ImageReward):
    """``-size_kb`` of the image as JPEG at ``quality`` (DDPO's compressibility): smaller files score higher.

    Example::

        JpegCompressibilityReward()([np.zeros((8, 8, 3), np.uint8)], [{}])  # -> [-0.6...]
    """

    name = "jpeg_compressibility"

    def __init__(self, quality: int = 95) -> None:
        self.quality = quality

    def score_images(self, images: np.ndarray, records: list[dict]) -> list[float]:
        return [-jpeg_size_kb(image, self.quality) for image in images]


class JpegIncompressibilityReward(ImageReward):
    """``size_kb`` of the image as JPEG at ``quality`` (DDPO's incompressibility): detail scores higher."""

    name = "jpeg_incompressibility"

    def __init__(self, quality: int = 95) -> None:
        self.quality = quality

    def score_images(self, images: np.ndarray, records: list[dict]) -> list[float]:
        return [jpeg_size_kb(image, self.quality) for image in images]


class BrightnessReward(ImageReward):
    """Mean pixel value in ``[0, 1]`` (0 = black, 1 = white)."""

    name = "brightness"

    def score_images(self, images: np.ndarray, records: list[dict]) -> np.ndarray:
        return images.reshape(len(images), -1).mean(axis=1) / 255.0


class TargetColorReward(ImageReward):
    """``1 - mean |pixel - target|`` over pixels and channels, in ``[0, 1]`` (1 = every pixel is the target).

    Args:
        color: the target RGB colour, each channel in ``[0, 1]``.
        color_key: a record key whose value (an RGB triple) overrides ``color`` for that prompt.

    Example::

        TargetColorReward(color=(1.0, 0.0, 0.0))  # reward red images
    """

    name = "target_color"

    def __init__(self, color: Sequence[float] = (1.0, 0.0, 0.0), color_key: str = "color") -> None:
        self.color = _rgb(color, "color")
        self.color_key = color_key

    def score_images(self, images: np.ndarray, records: list[dict]) -> np.ndarray:
        targets = np.stack(
            [
                _rgb(record[self.color_key], f"record[{self.color_key!r}]")
                if self.color_key in record
                else self.color
                for record in records
            ]
        )
        pixels = images.astype(np.float64) / 255.0  # [B, H, W, 3]
        return 1.0 - np.abs(pixels - targets[:, None, None, :]).mean(axis=(1, 2, 3))


def _rgb(value: Any, what: str) -> np.ndarray:
    array = np.asarray(value, dtype=np.float64)
    if array.shape != (3,) or not ((array >= 0) & (array <= 1)).all():
        raise ValueError(f"{what} must be an RGB triple with channels in [0, 1], got {value!r}")
    return array


class CallableImageReward(ImageReward):
    """Wrap any ``fn(images, records) -> [B]`` (``images``: ``uint8`` ``[B, H, W, 3]`` numpy) as a reward.

    Args:
        fn: the function, or its import path ``"pkg.mod:func"`` (imported in the worker, so the
            reward pickles as a string).
        name: for logs and errors; defaults to the path or the function's name.

    Example::

        # my_rewards.py:  def redness(images, records): return images[..., 0].mean(axis=(1, 2)) / 255
        CallableImageReward("my_rewards:redness")
    """

    def __init__(self, fn: str | Callable[[np.ndarray, list[dict]], Any], name: str | None = None) -> None:
        if not isinstance(fn, str) and not callable(fn):
            raise TypeError(f"CallableImageReward fn={fn!r} is neither a callable nor an import path string.")
        self.fn = fn
        self.name = name or (fn if isinstance(fn, str) else getattr(fn, "__name__", type(fn).__name__))
        self._resolved: Callable | None = None if isinstance(fn, str) else fn

    def score_images(self, images: np.ndarray, records: list[dict]) -> Any:
        if self._resolved is None:
            self._resolved = _import_callable(self.fn)  # type: ignore[arg-type]
        return self._resolved(images, records)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        if isinstance(self.fn, str):
            state["_resolved"] = None
        return state


# -- model-based rewards (optional: they load a user-given model; not run in the CPU tests) ---------
class _ModelReward(ImageReward):
    """Loads its model on first use, in the process that scores; pickles without it."""

    def __init__(self, device: str = "auto", batch_size: int = 32) -> None:
        self.device = device
        self.batch_size = batch_size
        self._model: Any = None

    def _torch_device(self) -> Any:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def _load(self) -> Any:  # pragma: no cover - needs model files
        raise NotImplementedError

    def score_images(self, images: np.ndarray, records: list[dict]) -> list[float]:  # pragma: no cover
        import torch

        if self._model is None:
            self._model = self._load()
        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(images), self.batch_size):
                end = start + self.batch_size
                scores.extend(self._score(images[start:end], records[start:end]))
        return scores

    def _score(self, images: np.ndarray, records: list[dict]) -> list[float]:  # pragma: no cover
        raise NotImplementedError

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_model"] = None
        return state


def _pil(images: np.ndarray) -> list[Any]:  # pragma: no cover - model rewards only
    from PIL import Image

    return [Image.fromarray(image) for image in images]


class PickScoreReward(_ModelReward):
    """PickScore (Kirstain et al. 2023): CLIP-H fine-tuned on human preferences, prompt-image score / 26.

    Args:
        model_path: e.g. ``"yuvalkirstain/PickScore_v1"`` or a local copy.
        processor_path: e.g. ``"laion/CLIP-ViT-H-14-laion2B-s32B-b79K"`` or a local copy.

    The score is ``logit_scale * cos(image, prompt) / 26``, as in Flow-GRPO (about 0.8-0.95).
    """

    name = "pickscore"

    def __init__(
        self,
        model_path: str = "yuvalkirstain/PickScore_v1",
        processor_path: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        device: str = "auto",
        batch_size: int = 32,
    ) -> None:
        super().__init__(device, batch_size)
        self.model_path = model_path
        self.processor_path = processor_path

    def _load(self) -> Any:  # pragma: no cover - needs model files
        from transformers import AutoModel, AutoProcessor

        processor = AutoProcessor.from_pretrained(self.processor_path)
        model = AutoModel.from_pretrained(self.model_path).eval().to(self._torch_device())
        return processor, model

    def _score(self, images: np.ndarray, records: list[dict]) -> list[float]:  # pragma: no cover
        import torch

        processor, model = self._model
        device = self._torch_device()
        pixel = processor(images=_pil(images), return_tensors="pt").to(device)
        text = processor(
            text=[str(r.get("prompt", "")) for r in records],
            padding=True,
            truncation=True,
            max_length=77,
            return_tensors="pt",
        ).to(device)
        image_embeds = torch.nn.functional.normalize(model.get_image_features(**pixel), dim=-1)
        text_embeds = torch.nn.functional.normalize(model.get_text_features(**text), dim=-1)
        scores = model.logit_scale.exp() * (image_embeds * text_embeds).sum(-1) / 26.0
        return scores.float().cpu().tolist()


class ClipScoreReward(_ModelReward):
    """CLIP score: cosine similarity of the image and prompt embeddings of a CLIP model at ``model_path``."""

    name = "clip_score"

    def __init__(
        self, model_path: str = "openai/clip-vit-large-patch14", device: str = "auto", batch_size: int = 32
    ) -> None:
        super().__init__(device, batch_size)
        self.model_path = model_path

    def _load(self) -> Any:  # pragma: no cover - needs model files
        from transformers import CLIPModel, CLIPProcessor

        processor = CLIPProcessor.from_pretrained(self.model_path)
        return processor, CLIPModel.from_pretrained(self.model_path).eval().to(self._torch_device())

    def _score(self, images: np.ndarray, records: list[dict]) -> list[float]:  # pragma: no cover
        import torch

        processor, model = self._model
        inputs = processor(
            text=[str(r.get("prompt", "")) for r in records],
            images=_pil(images),
            padding=True,
            truncation=True,
            return_tensors="pt",
        ).to(self._torch_device())
        image_embeds = torch.nn.functional.normalize(model.get_image_features(inputs["pixel_values"]), dim=-1)
        text_embeds = torch.nn.functional.normalize(
            model.get_text_features(inputs["input_ids"], inputs["attention_mask"]), dim=-1
        )
        return (image_embeds * text_embeds).sum(-1).float().cpu().tolist()


class AestheticReward(_ModelReward):
    """LAION aesthetic predictor: an MLP head (``head_path``, a torch state dict) on CLIP ViT-L/14 image embeddings.

    The head is the one DDPO uses (``sac+logos+ava1-l14-linearMSE.pth``); scores are roughly 1-10.
    """

    name = "aesthetic"

    def __init__(
        self,
        head_path: str,
        clip_path: str = "openai/clip-vit-large-patch14",
        device: str = "auto",
        batch_size: int = 32,
    ) -> None:
        super().__init__(device, batch_size)
        self.head_path = head_path
        self.clip_path = clip_path

    def _load(self) -> Any:  # pragma: no cover - needs model files
        import torch
        from transformers import CLIPModel, CLIPProcessor

        device = self._torch_device()
        head = torch.nn.Sequential(
            torch.nn.Linear(768, 1024),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(1024, 128),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(128, 64),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(64, 16),
            torch.nn.Linear(16, 1),
        )
        state = torch.load(self.head_path, map_location="cpu", weights_only=True)
        head.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})
        clip = CLIPModel.from_pretrained(self.clip_path).eval().to(device)
        return CLIPProcessor.from_pretrained(self.clip_path), clip, head.eval().to(device)

    def _score(self, images: np.ndarray, records: list[dict]) -> list[float]:  # pragma: no cover
        import torch

        processor, clip, head = self._model
        pixel = processor(images=_pil(images), return_tensors="pt").to(self._torch_device())
        embeds = torch.nn.functional.normalize(clip.get_image_features(**pixel), dim=-1)
        return head(embeds).squeeze(-1).float().cpu().tolist()
