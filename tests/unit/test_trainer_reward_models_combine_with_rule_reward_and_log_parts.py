"""The trainer's reward stage adds each reward model's weighted score of the sample's token ids to the weighted rule
reward, and logs every part as reward/<name>/mean; held-out accuracy counts the rule's verdict, not the sum (a
reward model's positive score on a wrong answer does not make it correct)."""

from types import SimpleNamespace

import pytest
import torch

from mrl.data.jagged import JaggedTensor
from mrl.reward.errors import RewardErrors
from mrl.reward.evaluator import RewardEvaluator
from mrl.trainer.metrics import held_out_accuracy, reward_part_metrics
from mrl.trainer.ppo_trainer import PPOTrainer


class Store:
    def __init__(self, ids):
        self.ids = ids

    def get_jagged(self, keys, fields):
        return {"input_ids": JaggedTensor.from_list([torch.tensor(self.ids[k]) for k in keys])}


class LengthModel:
    """A stand-in for RewardModels: scores a sequence by its length."""

    needs_token_ids = True

    def __init__(self):
        self.weights = {"len": 0.5}

    def score(self, sequences, texts):
        return {"len": [float(len(s)) for s in sequences]}


def test_scores_combine_by_weight_and_parts_are_logged():
    trainer = SimpleNamespace(
        config=SimpleNamespace(reward=SimpleNamespace(rule_weight=2.0)),
        parts=SimpleNamespace(reward=RewardEvaluator(lambda text, truth, extra: float(text == truth)),
                              reward_models=LengthModel()),
        store=Store({"a": [1, 2, 3], "b": [4, 5, 6, 7, 8]}),
        reward_errors=RewardErrors(1.0),
    )
    trainer.score_with_models = lambda trajs: PPOTrainer.score_with_models(trainer, trajs)
    trajectories = [{"key": "a", "response_text": "4"}, {"key": "b", "response_text": "5"}]
    prompts = [{"uid": "u", "messages": [], "ground_truth": "4", "extra_info": {}, "data_source": "x"}]
    with trainer.parts.reward:
        PPOTrainer.score(trainer, trajectories, prompts)
    assert [t["score"] for t in trajectories] == pytest.approx([2.0 * 1 + 0.5 * 3, 2.0 * 0 + 0.5 * 5])
    assert trajectories[1]["reward_parts"] == {"rule": 0.0, "len": 5.0}
    assert reward_part_metrics(trajectories) == {"reward/rule/mean": 0.5, "reward/len/mean": 4.0}
    # "b" is wrong (rule 0) yet scores 2.5 in total: it does not count as correct
    assert trajectories[1]["score"] > 0 and held_out_accuracy(trajectories) == 0.5
    assert held_out_accuracy([{"score": 1.0}, {"score": 0.0}]) == 0.5  # without reward models: the score is the rule


def test_held_out_accuracy_is_the_rules_verdict_when_the_rule_weighs_nothing():
    """reward.rule_weight 0 (training against reward models alone) leaves accuracy measurable."""
    trajectories = [{"score": 0.0, "reward_parts": {"rule": 1.0, "rm": 0.7}},
                    {"score": 0.9, "reward_parts": {"rule": 0.0, "rm": 0.9}}]
    assert held_out_accuracy(trajectories) == 0.5
