"""A discriminative reward model's score is the HF `...ForSequenceClassification` logit at the last token, whatever
the micro-batching and padding; a re-rendered score is the HF score of the retokenized text; parts combine by
their configured weights."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from mrl.data.synthetic import char_tokenizer
from mrl.models.tiny import make_tiny_reward_model, train_tiny_tokenizer
from mrl.reward.models import SequenceClassifierScorer, combine, length_balanced

TEXTS = ["What is two plus two? Two plus two is four.", "3+4=7", "hello",
         "The quick brown fox jumps over the lazy dog.",
         "Let us think step by step. First, add the numbers. Then, check the result. The answer is 42.", "12+9=21"]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    tok = train_tiny_tokenizer()
    path = make_tiny_reward_model("qwen2", tmp_path_factory.mktemp("rm"), tok, seed=3)
    return str(path), tok


def hf_scores(path, sequences):
    """Plain HF forward, one unpadded sequence at a time (HF pools the last non-pad token)."""
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([s])).logits[0, 0].item() for s in sequences]


@pytest.mark.parametrize("max_tokens", [1, 40, 100_000])
def test_scores_equal_hf_forward_for_every_micro_batch_budget(reward_model, max_tokens):
    path, tok = reward_model
    sequences = [tok.encode(t) for t in TEXTS]
    expected = hf_scores(path, sequences)
    got = SequenceClassifierScorer(path, max_tokens=max_tokens).score(sequences)
    assert len(set(map(len, sequences))) > 3 and max(abs(e) for e in expected) > 1e-2  # padding matters; not all ~0
    assert got == pytest.approx(expected, abs=1e-4)


def test_scores_equal_hf_own_right_padded_batch_pooling(reward_model):
    path, tok = reward_model
    tok.padding_side = "right"
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(**batch).logits[:, 0].tolist()
    got = SequenceClassifierScorer(path, max_tokens=64).score([tok.encode(t) for t in TEXTS])
    assert got == pytest.approx(expected, abs=1e-4)


def test_rerender_scores_the_reward_models_own_tokens(reward_model, tmp_path):
    path, _ = reward_model
    policy = char_tokenizer(tmp_path / "policy")
    texts = ["3+4=7", "12+9=21", "100+1=101"]
    policy_ids = [policy.encode(t, add_special_tokens=False) for t in texts]
    own = AutoTokenizer.from_pretrained(path)  # as loaded from the folder (the class its config names)
    expected = hf_scores(path, [own.encode(t, add_special_tokens=False) for t in texts])
    got = SequenceClassifierScorer(path, max_tokens=32, policy_tokenizer=str(tmp_path / "policy")).score(policy_ids)
    assert got == pytest.approx(expected, abs=1e-4)
    assert AutoTokenizer.from_pretrained(str(tmp_path / "policy")).get_vocab() != own.get_vocab()


def test_length_balanced_micro_batches_respect_the_budget_and_cover_every_sample():
    lengths = [5, 30, 7, 12, 30, 1, 64]
    batches = length_balanced(lengths, 60)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 60 for b in batches)
    assert [6] in batches  # longer than the budget: alone


def test_rule_and_model_scores_combine_by_their_weights():
    total = combine([1.0, 0.0], {"helpful": [2.0, -1.0], "safe": [0.5, 4.0]}, rule_weight=0.5,
                    weights={"helpful": 2.0, "safe": -1.0})
    assert total == pytest.approx([0.5 * 1 + 2 * 2 - 0.5, 0 + 2 * -1 - 4])
