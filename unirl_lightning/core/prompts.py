"""Prompt records -> prompt token ids, and the token ids that end a completion.

Contract: :func:`render_prompt` is *the* function that turns a prompt record into the token ids
a policy is conditioned on. Rollout engines call it to build what they generate from, and the
trainer calls it to rebuild the same context, so the two can never disagree on a chat template,
a system prompt or a BOS token. It depends on the tokenizer only (no engine, no module), so both
sides import it without importing each other.

A prompt record holds either

* ``"prompt"``: a plain string, tokenized as is (no special tokens added), or rendered as a
  single user turn when ``chat=True``; or
* ``"messages"``: a conversation ``[{"role": ..., "content": ...}, ...]``, which needs
  ``chat=True`` (it takes precedence over ``"prompt"``, which a chat record may still carry for
  logs).

With ``chat=True`` the text is ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``
and the ids are that text tokenized with ``add_special_tokens=False``: the template already holds
every special token, so none is added twice (no double BOS).

Example::

    >>> render_prompt(build_char_tokenizer(), {"prompt": "3="})
    [6, 16]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["CHAR_VOCAB", "build_char_tokenizer", "render_prompt", "render_prompt_text", "stop_token_ids"]

CHAR_VOCAB = ("<pad>", "<bos>", "<eos>", *"0123456789", "+", "-", "*", "=", " ", "?", ".", ",")
"""The character vocabulary of the tiny models built locally (the tiny policy, the tiny reward model)."""


def build_char_tokenizer(chars: tuple[str, ...] = CHAR_VOCAB):
    """A character-level ``PreTrainedTokenizerFast``: one token per character, decode without spaces."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?" if "?" in vocab else None))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", padding_side="left"
    )


_STOP_PROBE = "unirl-end-of-turn-probe"


def _messages(record: dict[str, Any], chat: bool, system_prompt: str | None) -> list[dict[str, str]] | None:
    """The conversation to render with the chat template, or ``None`` for a plain prompt."""
    messages = record.get("messages")
    if messages is not None:
        if not chat:
            raise ValueError(
                f"Prompt record has chat 'messages' ({len(messages)} turns) but chat=False; set chat=True to "
                "render them with the tokenizer's chat template, or give the record a plain 'prompt' string."
            )
        if not isinstance(messages, Sequence) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError(
                f"Prompt record 'messages'={messages!r:.200} is invalid; expected a list of "
                "{'role': str, 'content': str} dicts."
            )
        messages = list(messages)
    else:
        prompt = record.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError(
                f"Prompt record has no str 'prompt' and no 'messages' (keys: {sorted(record)}); expected one."
            )
        if not chat:
            if system_prompt is not None:
                raise ValueError(
                    f"system_prompt={system_prompt!r:.80} needs chat=True (a plain prompt has no system turn)."
                )
            return None
        messages = [{"role": "user", "content": prompt}]
    if system_prompt is not None:
        if messages and messages[0]["role"] == "system":
            raise ValueError(
                f"system_prompt={system_prompt!r:.80} given, but the record's messages already start with a "
                "system turn; give one or the other."
            )
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_prompt_text(
    tokenizer: Any, record: dict[str, Any], chat: bool = False, system_prompt: str | None = None
) -> str:
    """The prompt text :func:`render_prompt` tokenizes (the chat template applied when ``chat``).

    Raises:
        ValueError: the record has neither a str ``"prompt"`` nor valid ``"messages"``; it has
            ``"messages"`` but ``chat=False``; ``system_prompt`` without ``chat``, or together with
            messages that already start with a system turn; ``chat=True`` with a tokenizer that has
            no chat template.
    """
    messages = _messages(record, chat, system_prompt)
    if messages is None:
        return record["prompt"]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"chat=True but the tokenizer {type(tokenizer).__name__} "
            f"({getattr(tokenizer, 'name_or_path', '') or 'unnamed'}) has no chat template; set chat=False."
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def render_prompt(
    tokenizer: Any, record: dict[str, Any], chat: bool = False, system_prompt: str | None = None
) -> list[int]:
    """Token ids of a prompt record: its text (see :func:`render_prompt_text`) tokenized without
    adding special tokens.

    Args:
        tokenizer: A Hugging Face tokenizer.
        record: ``{"prompt": str}`` or ``{"messages": [{"role", "content"}, ...]}`` (plus any keys).
        chat: Render with the tokenizer's chat template, ending with the assistant's turn opener.
        system_prompt: A system turn put first (chat only).

    Raises:
        ValueError: as :func:`render_prompt_text`.
    """
    text = render_prompt_text(tokenizer, record, chat, system_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_token_ids(tokenizer: Any) -> list[int]:
    """Token ids that end a completion: the EOS token and the chat template's end-of-turn token.

    The end-of-turn token is read off the template itself: the first special token that follows
    the assistant's content when a user/assistant exchange is rendered (``<|im_end|>`` for
    ChatML templates such as SmolLM2's and Qwen's, ``<|eot_id|>`` for Llama 3). A tokenizer
    without a chat template stops at EOS only. Ids are unique, EOS first.
    """
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    if getattr(tokenizer, "chat_template", None):
        exchange = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _STOP_PROBE}]
        text = tokenizer.apply_chat_template(exchange, tokenize=False)
        after_reply = text[text.rindex(_STOP_PROBE) + len(_STOP_PROBE) :]
        special = set(tokenizer.all_special_ids) | {
            i for i, token in tokenizer.added_tokens_decoder.items() if token.special
        }
        end_of_turn = next(
            (i for i in tokenizer(after_reply, add_special_tokens=False)["input_ids"] if i in special), None
        )
        if end_of_turn is not None and end_of_turn not in ids:
            ids.append(int(end_of_turn))
    return ids
