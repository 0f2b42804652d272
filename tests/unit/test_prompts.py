"""Pins unirl_lightning.core.prompts: prompt records -> token ids (plain and chat, one BOS), the stop
ids read off the chat template, and the errors; with the char tokenizer and the real SmolLM2 one."""

from __future__ import annotations

import copy

import pytest

from tests.unit.real_model import needs_smollm2, smollm2_tokenizer
from unirl_lightning.core.prompts import render_prompt, render_prompt_text, stop_token_ids
from unirl_lightning.data import make_task
from unirl_lightning.models.causal_lm import CHAR_VOCAB, build_char_tokenizer

LETTERS = tuple("abcdefghijklmnopqrstuvwxyz:")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}<eot>{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture
def char_tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def char_chat_tokenizer():
    """The char tokenizer plus letters, a special end-of-turn token ``<eot>`` and a chat template."""
    tokenizer = build_char_tokenizer((*CHAR_VOCAB, "<eot>", *LETTERS))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<eot>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_tokenizer()


# ---------------------------------------------------------------- char tokenizer (chat off)


def test_plain_prompt_is_tokenized_as_is_without_special_tokens(char_tokenizer):
    ids = render_prompt(char_tokenizer, {"prompt": "3+4=", "answer": "7"})
    assert ids == char_tokenizer("3+4=", add_special_tokens=False)["input_ids"]
    assert char_tokenizer.convert_ids_to_tokens(ids) == ["3", "+", "4", "="]
    assert render_prompt_text(char_tokenizer, {"prompt": "3+4="}) == "3+4="


def test_char_tokenizer_stops_at_eos_only(char_tokenizer):
    assert stop_token_ids(char_tokenizer) == [char_tokenizer.eos_token_id] == [2]


def test_chat_records_need_chat_on_and_chat_needs_a_template(char_tokenizer):
    with pytest.raises(ValueError, match=r"has chat 'messages' \(1 turns\) but chat=False; set chat=True"):
        render_prompt(char_tokenizer, {"messages": [{"role": "user", "content": "1="}]})
    with pytest.raises(
        ValueError, match=r"chat=True but the tokenizer .* has no chat template; set chat=False"
    ):
        render_prompt(char_tokenizer, {"prompt": "1="}, chat=True)
    with pytest.raises(ValueError, match=r"system_prompt='Be brief.' needs chat=True"):
        render_prompt(char_tokenizer, {"prompt": "1="}, system_prompt="Be brief.")


def test_record_without_prompt_or_messages_names_its_keys(char_tokenizer):
    with pytest.raises(
        ValueError, match=r"no str 'prompt' and no 'messages' \(keys: \['answer', 'question'\]\)"
    ):
        render_prompt(char_tokenizer, {"question": "1=", "answer": "2"})
    with pytest.raises(ValueError, match=r"'messages'=\[\{'role': 'user'\}\] is invalid; expected a list of"):
        render_prompt(char_tokenizer, {"messages": [{"role": "user"}]}, chat=True)


# ---------------------------------------------------------------- char tokenizer with a chat template


def test_chat_prompt_ids_equal_the_template_tokenized_once_with_one_bos(char_chat_tokenizer):
    tokenizer = char_chat_tokenizer
    record = {"prompt": "3+4="}
    ids = render_prompt(tokenizer, record, chat=True)
    text = render_prompt_text(tokenizer, record, chat=True)
    assert text == "<bos>user:3+4=<eot>assistant:"
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": "3+4="}], add_generation_prompt=True, tokenize=True
    )
    assert ids == templated["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id


def test_system_prompt_is_the_first_turn_and_clashes_with_a_system_message(char_chat_tokenizer):
    text = render_prompt_text(char_chat_tokenizer, {"prompt": "1="}, chat=True, system_prompt="be")
    assert text == "<bos>system:be<eot>user:1=<eot>assistant:"
    messages = [{"role": "system", "content": "hi"}, {"role": "user", "content": "1="}]
    assert (
        render_prompt_text(char_chat_tokenizer, {"messages": messages, "prompt": "ignored"}, chat=True)
        == "<bos>system:hi<eot>user:1=<eot>assistant:"
    )
    with pytest.raises(
        ValueError, match=r"system_prompt='be' given, but the record's messages already start"
    ):
        render_prompt(char_chat_tokenizer, {"messages": messages}, chat=True, system_prompt="be")
    assert messages[0] == {"role": "system", "content": "hi"} and len(messages) == 2  # not mutated


def test_stop_ids_are_eos_then_the_templates_end_of_turn_token(char_chat_tokenizer):
    eot = char_chat_tokenizer.convert_tokens_to_ids("<eot>")
    assert stop_token_ids(char_chat_tokenizer) == [char_chat_tokenizer.eos_token_id, eot]


# ---------------------------------------------------------------- SmolLM2-135M-Instruct


@needs_smollm2
def test_smollm2_chat_prompt_ids_equal_the_template_tokenized_with_a_single_bos(smollm2):
    record = {"prompt": "What is 2+3?"}
    ids = render_prompt(smollm2, record, chat=True)
    text = render_prompt_text(smollm2, record, chat=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids == smollm2(text, add_special_tokens=False)["input_ids"] == smollm2(text)["input_ids"]
    templated = smollm2.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=True
    )
    assert ids == templated["input_ids"]
    # SmolLM2's BOS is <|im_start|>: one per turn (system, user, assistant), never doubled at the start
    assert ids[0] == smollm2.bos_token_id != ids[1] and ids.count(smollm2.bos_token_id) == 3
    assert smollm2.decode(ids[-4:]) == "<|im_start|>assistant\n"


@needs_smollm2
def test_smollm2_system_prompt_replaces_the_default_system_turn(smollm2):
    text = render_prompt_text(smollm2, {"prompt": "Hi"}, chat=True, system_prompt="Answer briefly.")
    assert text.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nHi")
    assert "SmolLM" not in text


@needs_smollm2
def test_smollm2_plain_prompt_adds_no_special_token(smollm2):
    ids = render_prompt(smollm2, {"prompt": "12+30="})
    assert smollm2.decode(ids) == "12+30="
    assert not set(ids) & set(smollm2.all_special_ids)


@needs_smollm2
def test_smollm2_eos_pad_and_end_of_turn_are_im_end(smollm2):
    assert smollm2.convert_ids_to_tokens([smollm2.eos_token_id, smollm2.pad_token_id]) == ["<|im_end|>"] * 2
    assert stop_token_ids(smollm2) == [2] and smollm2.convert_ids_to_tokens(2) == "<|im_end|>"


@needs_smollm2
def test_stop_ids_add_the_end_of_turn_when_eos_is_another_token(smollm2):
    tokenizer = copy.deepcopy(smollm2)
    tokenizer.eos_token = "<|endoftext|>"
    assert stop_token_ids(tokenizer) == [0, 2]


@needs_smollm2
def test_smollm2_word_problem_chat_prompts_fit_in_128_tokens(smollm2):
    lengths = [len(render_prompt(smollm2, r, chat=True)) for r in make_task("word_problems", 200, seed=0)]
    assert 40 < min(lengths) and max(lengths) <= 128
