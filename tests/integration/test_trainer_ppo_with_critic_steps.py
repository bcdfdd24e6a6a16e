"""PPO with a critic and a KL loss to a reference policy: a Megatron value engine (value head = a row of the
output layer) in its own worker group on the trainer's slot, the reference engine beside the actor in the actor's
workers, GAE on the driver, HF rollout replica (hybrid).

Proves: the critic makes B/M updates per step and its values move; with γ = λ = 1 the GAE returns on every model
token equal the trajectory's score, and prompt tokens carry none; before any update the reference log-probs equal
the actor's (two engines of the same weights in one process), and the KL term enters the actor loss.
"""

from __future__ import annotations

import random

import pytest
import torch

from mrl.config.loader import load_config
from mrl.data.datasets import write_rows
from mrl.models.tiny import make_tiny_hf_model
from mrl.trainer.build import build_trainer, shutdown
from mrl.trainer.ppo_trainer import PPOTrainer

pytestmark = pytest.mark.integration

B, M, N = 4, 2, 2


def odd_length_reward(solution_str, ground_truth, extra_info=None) -> float:
    return float(len(solution_str) % 2)


class RecordingTrainer(PPOTrainer):
    def compute_advantage(self, batch):
        self.batch = super().compute_advantage(batch)
        return self.batch


@pytest.fixture(scope="module")
def trainer(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer_ppo")
    model = make_tiny_hf_model("qwen2", root / "model", seed=1)
    rng = random.Random(1)
    rows = [{"prompt": [{"role": "user", "content": " ".join(rng.choice(["a", "b", "c"]) for _ in range(3))}],
             "data_source": "test", "reward_model": {"ground_truth": "x"}, "extra_info": {"index": i}}
            for i in range(8)]
    cfg = load_config("tiny/grpo", [
        f"model.path={model}", f"data.train_files=[{write_rows(rows, root / 'train.jsonl')}]",
        f"data.train_batch_size={B}", f"actor.ppo_mini_batch_size={M}", f"critic.ppo_mini_batch_size={M}",
        f"rollout.n={N}", "data.max_response_length=8", "rollout.name=hf", "critic.enable=true",
        "critic.ppo_micro_batch_size_per_gpu=2", "algorithm.adv_estimator=gae", "algorithm.gamma=1.0",
        "algorithm.lam=1.0", "critic.optim.lr=1e-2", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false", "trainer.test_freq=-1", f"trainer.default_local_dir={root / 'run'}",
        f"reward.reward_fn='{__name__}:odd_length_reward'",
    ])
    built = build_trainer(cfg)
    t = RecordingTrainer(built.config, built.parts, built.logger)
    yield t
    shutdown(t)


def test_ppo_steps_train_the_critic_and_gae_returns_equal_scores(trainer):
    first = trainer.step()
    batch = trainer.batch
    assert first["critic/updates"] == B // M and first["actor/updates"] == B // M
    ref, old = batch.jagged_field("ref_log_prob").values, batch.jagged_field("old_log_probs").values
    assert torch.allclose(ref, old, atol=1e-5) and "actor/kl_loss" in first
    assert torch.isfinite(torch.tensor(first["critic/vf_loss"]))
    mask = batch.as_list("response_mask")
    for i, returns in enumerate(batch.as_list("returns")):
        model = mask[i].bool()
        assert torch.allclose(returns[model], batch["score"][i].expand(int(model.sum())), atol=1e-5)
        assert torch.all(returns[~model] == 0) and torch.all(batch.as_list("advantages")[i][~model] == 0)
    values_before = batch.jagged_field("values").values.clone()
    trainer.step()
    after = trainer.parts.critic.compute_values(trainer.inputs(batch)).jagged_field("values").values
    moved = (after - values_before)[batch.jagged_field("response_mask").values.bool()]
    assert moved.abs().max() > 1e-4  # two critic steps at lr 1e-2 change the values it predicts
