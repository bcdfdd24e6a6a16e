"""The demo's learned reward (mrl/data/reverse_reward_model.py): its wrong answers are never the truth and include
the string not reversed and random strings; a short training run from a causal LM folder saves a one-label sequence
classifier with the policy's tokenizer that scores a sample's ids, and reports its held-out pairwise accuracy."""

import random

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from mrl.data.reverse_reward_model import near_misses, train_reward_model
from mrl.data.synthetic import char_tokenizer, reverse_rows, sft_example
from mrl.models.tiny import build_tiny_hf_model


def test_wrong_answers_are_never_the_truth_and_include_far_ones():
    rng = random.Random(0)
    for prompt in ("1234", "9528", "1111", "0901"):
        answer = prompt[::-1]
        misses = near_misses(prompt, answer, rng)
        assert answer not in misses and len(set(misses)) == len(misses)
        assert all(len(m) == len(answer) and m.isdigit() for m in misses)
        assert prompt in misses or prompt == answer  # a palindrome reads the same reversed


def test_a_short_training_saves_a_scoring_classifier(tmp_path):
    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    policy = build_tiny_hf_model("qwen2", seed=0, vocab_size=512, tokenizer=tokenizer, init_std=0.02)
    policy.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    train, val = reverse_rows(4, n_train=64, n_val=8, seed=0)
    report = train_reward_model(tokenizer, train, val, str(tmp_path / "policy"), tmp_path / "rm", steps=3,
                                batch_size=4, seed=0)
    assert report["rm_steps"] == 3 and 0.0 <= report["rm_val_pairwise_acc"] <= 1.0
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    assert AutoTokenizer.from_pretrained(tmp_path / "rm").get_vocab() == tokenizer.get_vocab()
    ids = torch.tensor([sft_example(tokenizer, val[0]["prompt"], "1234")[0]])
    assert model(input_ids=ids).logits.shape == (1, 1)
