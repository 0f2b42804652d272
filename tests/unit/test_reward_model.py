"""RewardModelReward: a tiny random-init sequence-classification model built here scores exactly as a
direct forward of the same model; batching, truncation, the head's index and sign; clear errors; it
pickles without its weights and is frozen."""

from __future__ import annotations

import pickle

import pytest
import torch

from unirl_lightning.rewards import CombinedReward, ExactMatchReward, RewardModelReward, score_parts
from unirl_lightning.rewards.reward_model import build_tiny_reward_model

CHAT = "{% for m in messages %}<bos>{{ '+' if m['role'] == 'user' else '*' }}{{ m['content'] }}<eos>{% endfor %}"  # a tiny chat template the character tokenizer spells (its vocabulary: digits, + - * = space ? . ,)

COMPLETIONS = ["12", "3456789", "0", "98 7"]
RECORDS = [{"prompt": "1+1="}, {"prompt": "2*3="}, {"prompt": "9-4="}, {"prompt": "7="}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_reward_model(str(tmp_path_factory.mktemp("rm") / "model"), num_labels=3, seed=1)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return build_tiny_reward_model(str(tmp_path_factory.mktemp("rm") / "chat"), chat_template=CHAT, seed=2)


def direct_scores(path: str, texts: list[str], index: int, add_special_tokens: bool = True) -> list[float]:
    """A forward of the saved model on each text alone (no padding, no batching)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    scores = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=add_special_tokens)
            scores.append(float(model(**ids).logits[0, index]))
    return scores


def test_scores_equal_a_direct_forward_of_the_same_model_one_by_one(model_dir):
    """One at a time the scores are the forward's exactly; in right-padded batches (3, then 1) they are
    within float32 rounding of it (the padded matmuls sum in another order)."""
    expected = direct_scores(model_dir, [r["prompt"] + c for r, c in zip(RECORDS, COMPLETIONS)], 2)
    assert RewardModelReward(model_dir, score_index=2, batch_size=1)(COMPLETIONS, RECORDS) == expected
    batched = RewardModelReward(model_dir, score_index=2, batch_size=3)(COMPLETIONS, RECORDS)
    assert batched == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert len(set(expected)) == len(expected)  # the texts really score differently


def test_batch_size_does_not_change_the_scores(model_dir):
    """Within float32 rounding: a padded batch of 4 sums in another order than one text alone (up to
    1.3e-6 on a score of 0.12 with transformers 5.25); a padding or index mistake moves a score by 1e-2
    or more (the four scores differ by that much)."""
    one = RewardModelReward(model_dir, batch_size=1)(COMPLETIONS, RECORDS)
    assert min(abs(a - b) for i, a in enumerate(one) for b in one[i + 1 :]) > 1e-2
    assert RewardModelReward(model_dir, batch_size=4)(COMPLETIONS, RECORDS) == pytest.approx(
        one, rel=0, abs=1e-5
    )


def test_score_index_and_scale_pick_the_logit_and_its_sign(model_dir):
    texts = [r["prompt"] + c for r, c in zip(RECORDS, COMPLETIONS)]
    for index in range(3):
        got = RewardModelReward(model_dir, score_index=index, scale=-2.0)(COMPLETIONS, RECORDS)
        assert got == pytest.approx([-2.0 * x for x in direct_scores(model_dir, texts, index)], abs=1e-5)


def test_truncation_keeps_max_length_tokens_from_the_chosen_side(model_dir):
    long = ["0123456789" * 3]
    record = [{"prompt": "3="}]
    text = "3=" + long[0]
    left = RewardModelReward(model_dir, max_length=5)(long, record)
    right = RewardModelReward(model_dir, max_length=5, truncation_side="right")(long, record)
    assert left == pytest.approx(direct_scores(model_dir, [text[-5:]], 0), abs=1e-6)  # the end is kept
    assert right == pytest.approx(direct_scores(model_dir, [text[:5]], 0), abs=1e-6)
    assert left != right


def test_the_chat_template_puts_the_prompt_in_a_user_turn_and_the_completion_in_an_assistant_turn(chat_dir):
    reward = RewardModelReward(chat_dir, batch_size=2)
    texts = reward.texts(["12"], [{"prompt": "3="}])
    assert texts == ["<bos>+3=<eos><bos>*12<eos>"]
    expected = direct_scores(
        chat_dir, [f"<bos>+{r['prompt']}<eos><bos>*{c}<eos>" for r, c in zip(RECORDS, COMPLETIONS)], 0, False
    )
    assert reward(COMPLETIONS, RECORDS) == pytest.approx(expected, rel=1e-6, abs=1e-6)
    plain = RewardModelReward(chat_dir, chat=False)
    assert plain.texts(["12"], [{"prompt": "3="}]) == ["3=12"]


def test_chat_true_without_a_template_fails_naming_the_key(model_dir):
    with pytest.raises(ValueError, match=r"chat=True.*no chat template"):
        RewardModelReward(model_dir, chat=True)(["1"], [{"prompt": "1="}])


def test_a_score_index_outside_the_head_fails_naming_the_key_and_the_labels(model_dir):
    with pytest.raises(
        ValueError, match=r"score_index=3 is outside the head .* 3 label\(s\): allowed 0\.\.2"
    ):
        RewardModelReward(model_dir, score_index=3)(["1"], [{"prompt": "1="}])
    with pytest.raises(ValueError, match=r"score_index must be >= 0, got -1"):
        RewardModelReward(model_dir, score_index=-1)


def test_a_model_without_a_classification_head_fails_naming_model_path(tmp_path):
    from unirl_lightning.models.causal_lm import TinyCausalLM

    model, tokenizer = TinyCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64).build()
    model.save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    with pytest.raises(
        ValueError, match=r"model_path=.*holds a LlamaForCausalLM, which has no classification head"
    ):
        RewardModelReward(str(tmp_path / "lm"))(["1"], [{"prompt": "1="}])


def test_a_checkpoint_whose_head_is_missing_fails_rather_than_scoring_noise(tmp_path, model_dir):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "headless"
    shutil.copytree(model_dir, folder)
    weights = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith("score.")}, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config.pop("architectures")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model_path=.*has no trained classification head.*score\.weight"):
        RewardModelReward(str(folder))(["1"], [{"prompt": "1="}])


def test_bad_settings_fail_at_construction_naming_the_key(model_dir):
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        RewardModelReward(model_dir, batch_size=0)
    with pytest.raises(ValueError, match="max_length must be >= 1, got 0"):
        RewardModelReward(model_dir, max_length=0)
    with pytest.raises(ValueError, match=r"device must be one of \('auto', 'cpu', 'cuda'\), got 'tpu'"):
        RewardModelReward(model_dir, device="tpu")


def test_it_loads_lazily_pickles_without_its_weights_and_is_frozen_in_eval_mode(model_dir):
    reward = RewardModelReward(model_dir, device="cpu")
    assert reward._loaded is None  # nothing loaded at construction
    reward(["1"], [{"prompt": "1="}])
    model, _ = reward.load()
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    copy = pickle.loads(pickle.dumps(reward))
    assert copy._loaded is None and len(pickle.dumps(reward)) < 2000
    assert copy(["1"], [{"prompt": "1="}]) == reward(["1"], [{"prompt": "1="}])


def test_combined_reward_mixes_it_with_a_rule_reward_and_logs_each_part(model_dir):
    model_reward = RewardModelReward(model_dir, name="rm")
    records = [{"prompt": "5+7=", "answer": "12"}, {"prompt": "0+1=", "answer": "1"}]
    totals, parts = score_parts(
        CombinedReward([model_reward, ExactMatchReward()], weights=[0.5, 1.0]), ["12", "34"], records
    )
    rm = model_reward(["12", "34"], records)
    assert parts == {"rm": pytest.approx(rm), "exact_match": [1.0, 0.0]}
    assert totals == pytest.approx([0.5 * rm[0] + 1.0, 0.5 * rm[1]])


def test_build_tiny_builds_the_model_on_first_use_only(tmp_path):
    path = tmp_path / "built"
    reward = RewardModelReward(str(path), build_tiny=True)
    assert not path.exists()
    first = reward(["1"], [{"prompt": "1="}])
    assert (path / "config.json").exists()
    assert RewardModelReward(str(path))(["1"], [{"prompt": "1="}]) == first
