"""Placement `pool`: reward models in CPU Ray actors of their own score a step's token ids exactly as a plain HF
forward does (fp32, within 1e-4), a re-rendering model included, each under its configured name and weight."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from mrl.data.synthetic import char_tokenizer
from mrl.models.tiny import make_tiny_reward_model, train_tiny_tokenizer
from mrl.reward.models import RewardModels

pytestmark = pytest.mark.integration


def hf_scores(path, sequences):
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([s])).logits[0, 0].item() for s in sequences]


def test_pool_models_score_like_hf(ray_cluster, tmp_path):
    policy = train_tiny_tokenizer(tmp_path / "policy")
    same = str(make_tiny_reward_model("qwen2", tmp_path / "same", policy, seed=1))
    other = str(make_tiny_reward_model("qwen2", tmp_path / "other", char_tokenizer(), seed=2))
    texts = ["3+4=7", "What is two plus two? Two plus two is four.", "12+9=21", "hello world"]
    ids = [AutoTokenizer.from_pretrained(str(tmp_path / "policy")).encode(t) for t in texts]
    spec = dict(kind="discriminative", placement="pool", num_cpus=1, max_tokens_per_micro_batch=24)
    models = RewardModels([SimpleNamespace(name="same", path=same, weight=0.5, rerender=False, **spec),
                           SimpleNamespace(name="other", path=other, weight=-1.0, rerender=True, **spec)],
                          str(tmp_path / "policy"))
    try:
        scores = models.score(ids)
    finally:
        models.close()
    own = AutoTokenizer.from_pretrained(other)
    assert models.weights == {"same": 0.5, "other": -1.0}
    assert scores["same"] == pytest.approx(hf_scores(same, ids), abs=1e-4)
    assert scores["other"] == pytest.approx(hf_scores(other, [own.encode(t) for t in texts]), abs=1e-4)
