"""Pins unirl_lightning.rewards.image: the rule rewards' values, the shape check, picklability."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from unirl_lightning.rewards import RewardError, score_batch
from unirl_lightning.rewards.image import (
    BrightnessReward,
    CallableImageReward,
    JpegCompressibilityReward,
    JpegIncompressibilityReward,
    TargetColorReward,
    to_uint8_images,
)
from unirl_lightning.rewards.image_models import AestheticReward, PickScoreReward


def solid(rgb: tuple[int, int, int], size: int = 16) -> np.ndarray:
    return np.broadcast_to(np.array(rgb, dtype=np.uint8), (size, size, 3)).copy()


def noise(size: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def wrong_shape(images, records):
    return np.zeros((len(images), 3))


def too_few(images, records):
    return [0.5] * (len(images) - 1)


def not_finite(images, records):
    return [float("nan")] * len(images)


def redness(images, records):
    return images[..., 0].mean(axis=(1, 2)) / 255.0


def test_jpeg_compressibility_prefers_flat_images_and_incompressibility_is_its_negative():
    images, records = [solid((40, 90, 200)), noise()], [{}, {}]
    compress = JpegCompressibilityReward()(images, records)
    incompress = JpegIncompressibilityReward()(images, records)
    assert compress[0] > compress[1], "a solid image must compress better than noise"
    assert incompress == [-c for c in compress]
    assert all(c < 0 for c in compress)  # -size in kB


def test_brightness_is_mean_pixel_value_in_unit_range():
    assert BrightnessReward()([solid((0, 0, 0)), solid((255, 255, 255)), solid((255, 0, 0))], [{}] * 3) == [
        0.0,
        1.0,
        pytest.approx(1 / 3),
    ]


def test_target_color_is_one_on_target_and_reads_a_per_record_override():
    reward = TargetColorReward(color=(1.0, 0.0, 0.0))
    red, blue = solid((255, 0, 0)), solid((0, 0, 255))
    assert reward([red, blue], [{}, {}]) == [1.0, pytest.approx(1 / 3)]
    assert reward([blue], [{"color": [0.0, 0.0, 1.0]}]) == [1.0]
    with pytest.raises(ValueError, match=r"color must be an RGB triple .* got \(2\.0, 0, 0\)"):
        TargetColorReward(color=(2.0, 0, 0))


def test_images_may_be_numpy_torch_or_pil():
    from PIL import Image

    red = solid((255, 0, 0))
    stacked = to_uint8_images([red, torch.from_numpy(red), Image.fromarray(red)])
    assert stacked.shape == (3, 16, 16, 3) and stacked.dtype == np.uint8
    with pytest.raises(ValueError, match=r"image 0 must be uint8 \[H, W, 3\], got dtype float32"):
        to_uint8_images([red.astype(np.float32)])


def test_any_callable_is_a_reward_also_by_import_path():
    images = [solid((255, 0, 0)), solid((0, 0, 0))]
    assert CallableImageReward(redness)(images, [{}, {}]) == [1.0, 0.0]
    by_path = CallableImageReward(f"{__name__}:redness")
    assert by_path.name == f"{__name__}:redness"
    assert pickle.loads(pickle.dumps(by_path))(images, [{}, {}]) == [1.0, 0.0]


def test_a_reward_returning_the_wrong_shape_fails_naming_the_value_and_shape():
    images = [solid((255, 0, 0))] * 2
    reward = CallableImageReward(wrong_shape)
    with pytest.raises(
        ValueError,
        match=r"'wrong_shape' returned array\(\[\[0\., 0\., 0\.\], \[0\., 0\., 0\.\]\]\) of shape \(2, 3\); "
        r"expected shape \(2,\)",
    ):
        reward(images, [{}, {}])
    # through the checked entry point the workers use: a RewardError that carries the same message
    with pytest.raises(RewardError, match=r"shape \(2, 3\); expected shape \(2,\): one score per image"):
        score_batch(reward, images, [{"prompt": "p"}] * 2)
    with pytest.raises(ValueError, match=r"returned \[0\.5\] of shape \(1,\); expected shape \(2,\)"):
        CallableImageReward(too_few)(images, [{}, {}])
    with pytest.raises(ValueError, match=r"returned \[nan, nan\]; every score must be finite"):
        CallableImageReward(not_finite)(images, [{}, {}])


def test_model_rewards_pickle_as_paths_and_load_nothing_when_built():
    pick = PickScoreReward(model_path="/models/pickscore", processor_path="/models/clip-h")
    aesthetic = AestheticReward(head_path="/models/aesthetic.pth")
    for reward in (pick, aesthetic):
        clone = pickle.loads(pickle.dumps(reward))
        assert clone._model is None and clone.__dict__ == reward.__dict__
