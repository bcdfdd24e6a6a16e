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


def test_validation_scores_with_models_before_it_drops_the_samples(ray_cluster, tmp_path):
    """The trainer's validation path (generate, score, drop the samples from the store): a discriminative model
    reads each sample's token ids from the store, so the scores must be taken before the samples are dropped."""
    from mrl.data.sample_store import SampleStore
    from mrl.reward.errors import RewardErrors
    from mrl.reward.evaluator import RewardEvaluator
    from mrl.trainer.ppo_trainer import PPOTrainer

    policy = train_tiny_tokenizer(tmp_path / "policy")
    path = str(make_tiny_reward_model("qwen2", tmp_path / "rm", policy, seed=3))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "policy"))
    store = SampleStore.create(num_units=1)
    prompts = [{"uid": f"u{i}", "messages": [{"role": "user", "content": q}], "ground_truth": a,
                "data_source": "exact_match", "extra_info": {}} for i, (q, a) in enumerate([("3+4", "7"),
                                                                                               ("2+2", "4")])]
    answers = ["7", "5", "4", "4"]  # two samples per prompt
    ids = [tok.encode(f"{p['messages'][0]['content']}={a}") for p, a in zip([prompts[0]] * 2 + [prompts[1]] * 2,
                                                                            answers)]

    class Generated:
        """The agent loops' part of validation: samples whose token ids lie in the store, their texts returned."""

        @staticmethod
        def generate(chunk, n, sampling):
            keys = store.put({f"v{i}": {"input_ids": torch.tensor(row)} for i, row in enumerate(ids)})
            return [{"key": k, "response_text": a} for k, a in zip(keys, answers)]

    spec = dict(kind="discriminative", placement="pool", num_cpus=1, max_tokens_per_micro_batch=64, rerender=False)
    models = RewardModels([SimpleNamespace(name="rm", path=path, weight=1.0, **spec)], str(tmp_path / "policy"))
    rule = RewardEvaluator(None)
    trainer = SimpleNamespace(config=SimpleNamespace(reward=SimpleNamespace(rule_weight=1.0)), store=store,
                              parts=SimpleNamespace(reward=rule, reward_models=models, agent_loops=Generated()),
                              reward_errors=RewardErrors(1.0))
    trainer.score = lambda trajs, chunk: PPOTrainer.score(trainer, trajs, chunk)
    trainer.score_with_models = lambda trajs: PPOTrainer.score_with_models(trainer, trajs)
    try:
        scored = PPOTrainer.generate_scored(trainer, prompts, 2, {}, batch_size=2)
    finally:
        models.close()
        rule.close()
    assert [t["reward_parts"]["rm"] for t in scored] == pytest.approx(hf_scores(path, ids), abs=1e-4)
    assert [t["reward_parts"]["rule"] for t in scored] == [1.0, 0.0, 1.0, 1.0]
    assert sum(store.size().values()) == 0  # validation samples are never trained on: dropped after scoring
