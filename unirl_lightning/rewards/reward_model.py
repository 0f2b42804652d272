"""A learned reward model: an ``AutoModelForSequenceClassification`` scoring ``(prompt, completion)``.

Who calls it
    :func:`~unirl_lightning.rewards.score_batch`, in the process that scores: a rollout worker by
    default, or a reward worker of its own when the strategy sets ``reward_workers`` (see
    :class:`~unirl_lightning.workers.reward.RewardWorkerPool`). It is declared in the module's YAML
    like any reward, alone or inside a :class:`~unirl_lightning.rewards.CombinedReward`.

What it guarantees
    The model is loaded lazily, on the first call, in the process that calls (the object pickles as
    its settings, never its weights), in eval mode with every parameter frozen
    (``requires_grad=False``), and scores under ``torch.inference_mode``. Weight pushes go to the
    policy's engines only: nothing ever loads new weights into the reward model. A score is
    ``scale * logits[score_index]`` of the classification head at the sequence's last token, the
    same number a direct forward of the model on that one sequence gives (batches are right-padded,
    so positions and the pooled token do not move).

What raises
    ``ValueError`` naming the key: a bad ``batch_size`` / ``max_length`` at construction; at the
    first call a folder whose model has no classification head (``model_path``), or a
    ``score_index`` outside the head's labels.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Literal

from unirl_lightning.core.checks import require_at_least, require_choice
from unirl_lightning.rewards.base import Reward

__all__ = ["RewardModelReward", "build_tiny_reward_model"]

Device = Literal["auto", "cpu", "cuda"]
DType = Literal["float32", "bfloat16", "float16"]
Side = Literal["left", "right"]


class RewardModelReward(Reward):
    """Scores each ``(record[prompt_key], completion)`` with a sequence-classification reward model.

    The text is the tokenizer's chat template over ``[{"role": "user", "content": prompt},
    {"role": "assistant", "content": completion}]`` when the tokenizer has one (and ``chat`` is not
    False), else ``prompt + completion``; it is cut to ``max_length`` tokens from the
    ``truncation_side`` (``"left"`` by default: the end of the completion, where the head reads, is
    kept) and scored ``batch_size`` sequences at a time.

    Args:
        model_path: a local folder (or hub id, when the machine may download) holding the model and
            its tokenizer, as ``save_pretrained`` writes them.
        name: the reward's name in logs (``rollout/reward/<name>_mean``) and errors.
        score_index: which logit of the head is the score (0 for a one-label reward model).
        scale: the score is ``scale * logit``: -1 flips the sign, another number rescales it.
        max_length: tokens kept of each sequence (longer ones are truncated).
        truncation_side: which side a long sequence loses tokens from: ``"left"`` or ``"right"``.
        batch_size: sequences per forward pass.
        device: ``"auto"`` (CUDA when the scoring process sees a GPU, else CPU), ``"cpu"`` or ``"cuda"``.
        dtype: the model's weights and compute: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        chat: None = use the chat template when the tokenizer has one; False = never; True = always
            (an error when the tokenizer has none).
        prompt_key: the record key holding the prompt text.
        build_tiny: when ``model_path`` does not exist, build a tiny random-init reward model there
            first (:func:`build_tiny_reward_model`): for the CPU example and tests only.

    Example::

        reward:
          class_path: unirl_lightning.rewards.RewardModelReward
          init_args: {model_path: /models/my-rm, max_length: 2048, batch_size: 8}
    """

    def __init__(
        self,
        model_path: str,
        name: str = "reward_model",
        score_index: int = 0,
        scale: float = 1.0,
        max_length: int = 1024,
        truncation_side: Side = "left",
        batch_size: int = 16,
        device: Device = "auto",
        dtype: DType = "float32",
        chat: bool | None = None,
        prompt_key: str = "prompt",
        build_tiny: bool = False,
    ) -> None:
        require_at_least("score_index", score_index, 0)
        require_at_least("max_length", max_length, 1)
        require_at_least("batch_size", batch_size, 1)
        require_choice("device", device, Device)
        require_choice("dtype", dtype, DType)
        require_choice("truncation_side", truncation_side, Side)
        self.model_path = (
            os.path.abspath(model_path) if os.path.exists(model_path) or build_tiny else model_path
        )
        self.name = name
        self.score_index = int(score_index)
        self.scale = float(scale)
        self.max_length = int(max_length)
        self.truncation_side = truncation_side
        self.batch_size = int(batch_size)
        self.device = device
        self.dtype = dtype
        self.chat = chat
        self.prompt_key = prompt_key
        self.build_tiny = build_tiny
        self._loaded: tuple[Any, Any] | None = None  # (model, tokenizer), in the scoring process only

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_loaded"] = None  # ship the settings, never the weights
        return state

    # -- loading ------------------------------------------------------------------------------------
    def torch_device(self) -> Any:
        """The device the model runs on in this process (``device``; ``"auto"``: CUDA when visible)."""
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def load(self) -> tuple[Any, Any]:
        """The frozen model and its tokenizer, loaded on the first call in this process (then kept)."""
        if self._loaded is None:
            self._loaded = self._load()
        return self._loaded

    def _load(self) -> tuple[Any, Any]:
        import torch
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        if self.build_tiny and not os.path.exists(self.model_path):
            build_tiny_reward_model(self.model_path)
        config = AutoConfig.from_pretrained(self.model_path)
        architectures = list(getattr(config, "architectures", None) or [])
        if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise ValueError(
                f"RewardModelReward model_path={self.model_path!r} holds a {architectures[0]}, which has no "
                "classification head: a reward model is saved as a *ForSequenceClassification model "
                "(AutoModelForSequenceClassification) with a trained score head"
            )
        model, info = AutoModelForSequenceClassification.from_pretrained(
            self.model_path, dtype=getattr(torch, self.dtype), output_loading_info=True
        )
        missing = [
            key for key in info.get("missing_keys", ()) if key.split(".")[0] in ("score", "classifier")
        ]
        if missing:
            raise ValueError(
                f"RewardModelReward model_path={self.model_path!r} has no trained classification head (the "
                f"checkpoint lacks {sorted(missing)}): a head initialised at random would score noise"
            )
        labels = int(model.config.num_labels)
        if not 0 <= self.score_index < labels:
            raise ValueError(
                f"RewardModelReward score_index={self.score_index} is outside the head of model_path="
                f"{self.model_path!r}, which has {labels} label(s): allowed 0..{labels - 1}"
            )
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:  # batches need it: the head pools the last non-pad token
            model.config.pad_token_id = tokenizer.pad_token_id
        tokenizer.padding_side = "right"  # positions of the real tokens stay those of a lone forward
        tokenizer.truncation_side = self.truncation_side
        if self.chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"RewardModelReward chat=True, but the tokenizer of model_path={self.model_path!r} has no chat "
                "template: set chat to null (auto) or false"
            )
        model.requires_grad_(False)
        return model.eval().to(self.torch_device()), tokenizer

    # -- scoring ------------------------------------------------------------------------------------
    def texts(self, completions: list[str], records: list[dict]) -> list[str]:
        """The text scored for each completion (chat template or ``prompt + completion``)."""
        _, tokenizer = self.load()
        chat = bool(getattr(tokenizer, "chat_template", None)) if self.chat is None else self.chat
        prompts = [str(record.get(self.prompt_key, "")) for record in records]
        if not chat:
            return [prompt + completion for prompt, completion in zip(prompts, completions)]
        return [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
                tokenize=False,
            )
            for prompt, completion in zip(prompts, completions)
        ]

    def encode(self, texts: list[str]) -> Any:
        """``texts`` tokenized as one right-padded batch, cut to ``max_length`` tokens."""
        _, tokenizer = self.load()
        chat = bool(getattr(tokenizer, "chat_template", None)) if self.chat is None else self.chat
        return tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=self.max_length,
            add_special_tokens=not chat,  # a chat template writes its own special tokens
            return_tensors="pt",
        )

    def __call__(self, completions: list[str], records: list[dict]) -> list[float]:
        import torch

        model, _ = self.load()
        texts = self.texts(completions, records)
        device = self.torch_device()
        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self.encode(texts[start : start + self.batch_size]).to(device)
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                scores.extend((self.scale * logits[:, self.score_index].float()).cpu().tolist())
        return scores

    def __repr__(self) -> str:
        return f"RewardModelReward(name={self.name!r}, model_path={self.model_path!r})"


def build_tiny_reward_model(
    path: str,
    hidden_size: int = 32,
    num_layers: int = 1,
    num_heads: int = 2,
    num_labels: int = 1,
    seed: int = 0,
    chat_template: str | None = None,
) -> str:
    """Write a tiny random-init ``LlamaForSequenceClassification`` and its character tokenizer to
    ``path`` (built locally, nothing downloaded); returns ``path``. The folder appears whole or not at
    all (written next to it, then renamed), so processes racing to build it agree.

    One-liner for the CPU example::

        python -c "from unirl_lightning.rewards import build_tiny_reward_model as b; b('runs/tiny_reward_model')"
    """
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from unirl_lightning.core.prompts import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=4096,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
        torch.nn.init.normal_(model.score.weight, std=1.0)  # scores that differ visibly between texts
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    partial = tempfile.mkdtemp(prefix=".tiny-rm-", dir=parent)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    try:
        os.rename(partial, path)
    except OSError:  # another process built it first
        import shutil

        shutil.rmtree(partial, ignore_errors=True)
        if not os.path.isdir(path):
            raise
    return path
