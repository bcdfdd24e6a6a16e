"""Bypass mode (rollout.recompute_old_log_prob=false): the old log-prob stage reuses the rollout engine's log-probs
as π_old without calling any worker, and the mismatch metrics then read exactly 1 / 0."""

from omegaconf import OmegaConf

from mrl.config.loader import load_config
from mrl.data.datasets import RLDataset
from mrl.trainer.batching import logprob_mismatch, trajectories_to_batch
from mrl.trainer.ppo_trainer import PPOTrainer, TrainerParts


def test_bypass_uses_rollout_log_probs_as_old_log_probs():
    cfg = load_config("tiny/grpo", ["model.path=unused", "rollout.recompute_old_log_prob=false",
                                    "data.train_batch_size=1", "actor.ppo_mini_batch_size=1"], check_paths=False)
    data = RLDataset([{"prompt": "q", "reward_model": {"ground_truth": "a"}}])
    # No worker group: a call to one would fail, so passing proves the stage made none.
    parts = TrainerParts(actor_rollout=None, rollout=None, agent_loops=None, tokenizer=None, train_data=data,
                         val_data=None, reward=None)
    trainer = PPOTrainer(OmegaConf.to_object(cfg), parts)
    batch = trajectories_to_batch([
        {"uid": "u", "score": 1.0, "prompt_ids": [1, 2], "response_ids": [3, 4], "response_mask": [1, 1],
         "rollout_log_probs": [-0.25, -1.5]},
    ])
    out = trainer.compute_old_log_prob(batch)
    assert out.as_list("old_log_probs")[0].tolist() == [0.0, 0.0, -0.25, -1.5]
    metrics = logprob_mismatch(out)
    assert metrics["rollout/logprob_mismatch"] == 1.0 and metrics["rollout/logprob_abs_diff_max"] == 0.0
