"""What one episode is made of, on the worker side: its settings (:class:`EpisodeSettings`), the request
that starts it (:class:`EpisodeRequest`), and the token ids of its turns' text (the initial observation,
an observation appended after a model turn, the chat template's end of a turn the token budget cut).

The :class:`~unirl_lightning.envs.coordinator.EpisodeCoordinator` plays episodes with these; its module
docstring says how. This module imports no torch: the standard library and :mod:`unirl_lightning.envs.base`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from unirl_lightning.envs.base import Observation

__all__ = ["EpisodeRequest", "EpisodeSettings", "OnEnvError", "TruncatedTurn", "context_limit"]
__all__ += ["observation_ids", "prompt_ids_of", "turn_closing_ids"]

OnEnvError = Literal["raise", "drop"]
_ON_ENV_ERROR = ("raise", "drop")
TruncatedTurn = Literal["close", "end"]
_TRUNCATED_TURN = ("close", "end")
_CHAT_PREFIX = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
_CLOSING_PROBE = "UNIRL_TURN_CLOSING_PROBE"


@dataclass(frozen=True)
class EpisodeSettings:
    """How a coordinator plays episodes, beyond the environment and the sampling.

    Attributes:
        on_env_error: ``"raise"`` or ``"drop"`` (see the module docstring).
        truncated_turn: a chat model turn cut at ``max_new_tokens``: ``"close"`` appends the chat
            template's end of turn (``loss_mask`` 0) before the next observation, ``"end"`` ends the
            episode there (see the module docstring).
        max_context_tokens: an episode ends (cleanly, with its return so far) before a model turn
            would take its context (prompt + every token so far + ``max_new_tokens``) past this;
            None = only the engine's ``max_model_len``, if it has one.
    """

    on_env_error: OnEnvError = "raise"
    truncated_turn: TruncatedTurn = "close"
    max_context_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.on_env_error not in _ON_ENV_ERROR:
            raise ValueError(f"on_env_error must be one of {_ON_ENV_ERROR}, got {self.on_env_error!r}")
        if self.truncated_turn not in _TRUNCATED_TURN:
            raise ValueError(f"truncated_turn must be one of {_TRUNCATED_TURN}, got {self.truncated_turn!r}")
        limit = self.max_context_tokens
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ValueError(f"max_context_tokens must be None or an int >= 1, got {limit!r}")


@dataclass(frozen=True)
class EpisodeRequest:
    """One episode to play: ``sample_id`` ``"root/k"`` (the k-th sibling of group ``root``), the prompt
    record and the seed of its environment (``reset(record, seed)``).

    A request whose ``sample_id`` is suspended in the coordinator resumes that episode (the record
    and seed are then not used again).
    """

    sample_id: str
    record: dict[str, Any]
    seed: int = 0


def prompt_ids_of(tokenizer: Any, observation: Observation) -> list[int]:
    """The token ids of an initial observation: a raw string as is (no special tokens added, like
    single-turn prompts), chat messages rendered with the tokenizer's chat template plus the
    generation prompt."""
    if isinstance(observation, str):
        return list(tokenizer(observation, add_special_tokens=False)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the environment's initial observation is chat messages, but the policy's tokenizer has no chat "
            "template; use an instruction-tuned model or the environment's raw-string syntax (e.g. compact)"
        )
    text = tokenizer.apply_chat_template(observation, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def observation_ids(tokenizer: Any, observation: str, chat_role: str | None) -> list[int]:
    """The token ids appended after a model turn for an environment observation.

    ``chat_role=None`` (the episode began with a raw string): the observation text as is. Otherwise
    the observation as one chat message of that role followed by the generation prompt: the part
    of the chat template's rendering that a message adds after a finished assistant turn (the
    rendering of a fixed two-message conversation with and without it; the model's own end-of-turn
    token, already sampled, closes the turn before it).
    """
    if chat_role is None:
        return list(tokenizer(observation, add_special_tokens=False)["input_ids"])
    base = tokenizer.apply_chat_template(_CHAT_PREFIX, tokenize=False)
    message = {"role": chat_role, "content": observation}
    full = tokenizer.apply_chat_template([*_CHAT_PREFIX, message], add_generation_prompt=True, tokenize=False)
    if not full.startswith(base):
        raise ValueError(
            "the chat template renders a conversation differently once a message is appended, so an "
            "observation cannot be appended as tokens; give the environment a raw-string syntax"
        )
    return list(tokenizer(full[len(base) :], add_special_tokens=False)["input_ids"])


def turn_closing_ids(tokenizer: Any) -> list[int]:
    """The token ids the chat template renders after an assistant message's content (its end of
    turn, e.g. ``<|im_end|>`` and a newline for ChatML, ``<|eot_id|>`` for Llama 3): what closes a
    model turn the token budget cut before the model sampled its end-of-turn token."""
    exchange = [_CHAT_PREFIX[0], {"role": "assistant", "content": _CLOSING_PROBE}]
    text = tokenizer.apply_chat_template(exchange, tokenize=False)
    closing = text[text.rindex(_CLOSING_PROBE) + len(_CLOSING_PROBE) :]
    return list(tokenizer(closing, add_special_tokens=False)["input_ids"]) if closing else []


def context_limit(max_context_tokens: int | None, max_model_len: Any) -> int | None:
    """The tighter of the configured budget and the engine's ``max_model_len`` (an int >= 1, if any)."""
    limits = [max_context_tokens] if max_context_tokens is not None else []
    if isinstance(max_model_len, int) and not isinstance(max_model_len, bool) and max_model_len > 0:
        limits.append(max_model_len)
    return min(limits) if limits else None
