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
:class:`CallableImageReward` wraps any function. Model-based rewards (``PickScoreReward``,
``ClipScoreReward``, ``AestheticReward``, in :mod:`unirl_lightning.rewards.image_models`) load a
model from a path the user gives, lazily, inside the worker that first scores with them.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from unirl_lightning.rewards.base import Reward
from unirl_lightning.rewards.callable import CallableFunction

__all__ = [
    "BrightnessReward",
    "CallableImageReward",
    "ImageReward",
    "JpegCompressibilityReward",
    "JpegIncompressibilityReward",
    "TargetColorReward",
    "check_image_scores",
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


class CallableImageReward(CallableFunction, ImageReward):
    """Wrap any ``fn(images, records) -> [B]`` (``images``: ``uint8`` ``[B, H, W, 3]`` numpy) as a reward.

    Args:
        fn: the function, or its import path ``"pkg.mod:func"`` (imported in the worker, so the
            reward pickles as a string; see :class:`~unirl_lightning.rewards.callable.CallableFunction`).
        name: for logs and errors; defaults to the path or the function's name.

    Example::

        # my_rewards.py:  def redness(images, records): return images[..., 0].mean(axis=(1, 2)) / 255
        CallableImageReward("my_rewards:redness")
    """

    def score_images(self, images: np.ndarray, records: list[dict]) -> Any:
        return self.function(images, records)
