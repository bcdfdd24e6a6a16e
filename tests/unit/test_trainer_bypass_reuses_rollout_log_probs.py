"""Bypass mode (rollout.recompute_old_log_prob=false): the old log-prob stage calls no worker, so it measures no
trainer-vs-rollout mismatch and reports none (a constant logprob_mismatch of 1.0 would claim an agreement nobody
measured); the workers then read the rollout's log-probs wherever they ask for old ones
(tests/integration/test_sample_store_fetch_by_key_masks_noops_and_writes_back.py)."""

from omegaconf import OmegaConf

from mrl.config.startup.loader import load_config
from mrl.data.datasets import RLDataset
from mrl.data.samples import light_batch
from mrl.trainer.ppo_trainer import PPOTrainer, TrainerParts


def test_bypass_makes_no_worker_call_and_reports_no_mismatch_it_did_not_measure():
    cfg = load_config("tiny/grpo", ["model.path=unused", "rollout.recompute_old_log_prob=false",
                                    "data.train_batch_size=1", "actor.ppo_mini_batch_size=1"], check_paths=False)
    data = RLDataset([{"prompt": "q", "reward_model": {"ground_truth": "a"}}])
    # No worker group: a call to one would fail, so passing proves the stage made none.
    parts = TrainerParts(actor_rollout=None, rollout=None, agent_loops=None, tokenizer=None, train_data=data,
                         val_data=None, reward=None)
    trainer = PPOTrainer(OmegaConf.to_object(cfg), parts)
    batch = light_batch([{"key": "k", "uid": "u", "score": 1.0, "prompt_len": 2, "response_len": 2}])
    metrics = trainer.compute_old_log_prob(batch)
    assert not any(key.startswith(("rollout/", "rollout_corr/")) for key in metrics)
