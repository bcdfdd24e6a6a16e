"""Bypass mode (rollout.recompute_old_log_prob=false): the old log-prob stage calls no worker and reports the
mismatch metrics of π_old = π_rollout exactly (1 / 0 / 0); the workers then read the rollout's log-probs wherever
they ask for old ones (tests/integration/test_sample_path_keeps_token_data_off_the_driver.py)."""

from omegaconf import OmegaConf

from mrl.config.loader import load_config
from mrl.data.datasets import RLDataset
from mrl.data.samples import light_batch
from mrl.trainer.ppo_trainer import PPOTrainer, TrainerParts


def test_bypass_makes_no_worker_call_and_reports_exact_agreement():
    cfg = load_config("tiny/grpo", ["model.path=unused", "rollout.recompute_old_log_prob=false",
                                    "data.train_batch_size=1", "actor.ppo_mini_batch_size=1"], check_paths=False)
    data = RLDataset([{"prompt": "q", "reward_model": {"ground_truth": "a"}}])
    # No worker group: a call to one would fail, so passing proves the stage made none.
    parts = TrainerParts(actor_rollout=None, rollout=None, agent_loops=None, tokenizer=None, train_data=data,
                         val_data=None, reward=None)
    trainer = PPOTrainer(OmegaConf.to_object(cfg), parts)
    batch = light_batch([{"key": "k", "uid": "u", "score": 1.0, "prompt_len": 2, "response_len": 2}])
    metrics = trainer.compute_old_log_prob(batch)
    assert metrics["rollout/logprob_mismatch"] == 1.0 and metrics["rollout/logprob_abs_diff_max"] == 0.0
    assert metrics["rollout/mismatch_kl"] == 0.0
