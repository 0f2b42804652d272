"""Model-based image rewards (PickScore, CLIP score, LAION aesthetic): optional, for GPU recipes.

Each loads its model from a path the user gives, lazily, inside the worker that first scores with
it, and pickles without it (as its paths). Same contract as
:class:`~unirl_lightning.rewards.image.ImageReward`. Not run in the CPU tests (they need model files).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from unirl_lightning.rewards.image import ImageReward

__all__ = ["AestheticReward", "ClipScoreReward", "PickScoreReward"]


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
