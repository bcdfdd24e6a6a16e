"""Dynamic sampling that keeps no group within data.max_sample_rounds (every group's rewards equal) hands the
workers nothing: the step trains nothing, logs `train/skipped_step` = 1 and a warning, deletes the evicted samples
from the store and still counts, so the run ends after total_training_steps."""

from types import SimpleNamespace

from omegaconf import OmegaConf

from mrl.config.startup.loader import load_config
from mrl.data.datasets import RLDataset
from mrl.reward.evaluator import RewardResult
from mrl.trainer.ppo_trainer import PPOTrainer, TrainerParts

N, ROUNDS = 2, 3


class SameAnswerEverywhere:
    """Agent loops whose n responses to a prompt are all alike, so every group's rewards are equal."""

    def __init__(self) -> None:
        self.rounds = 0

    def generate(self, prompts, n, sampling):
        self.rounds += 1
        return [{"key": f"{p['uid']}/{i}", "response_text": "x", "prompt_len": 2, "response_len": 1,
                 "model_tokens": 1, "min_version": 0, "max_version": 0} for p in prompts for i in range(n)]


class NoWorkers:
    """Any call to a worker group fails the test: nothing may train on an empty batch."""

    def __getattr__(self, name):
        raise AssertionError(f"the trainer called the workers ({name}) without samples")


class Store:
    def __init__(self) -> None:
        self.deleted: list[str] = []

    def delete(self, keys):
        self.deleted += keys
        return len(keys)


def test_a_step_without_groups_trains_nothing_and_counts(capsys):
    cfg = load_config("tiny/grpo", [
        "model.path=unused", "data.dynamic_sampling=true", f"data.max_sample_rounds={ROUNDS}", f"rollout.n={N}",
        "data.train_batch_size=2", "actor.ppo_mini_batch_size=1", "rollout.free_cache_engine=false",
        "trainer.test_freq=-1"], check_paths=False)
    data = RLDataset([{"prompt": [{"role": "user", "content": f"q{i}"}], "reward_model": {"ground_truth": "a"}}
                      for i in range(4)])
    loops, store = SameAnswerEverywhere(), Store()
    reward = SimpleNamespace(evaluate_sync=lambda items: [RewardResult(1.0) for _ in items])
    parts = TrainerParts(actor_rollout=NoWorkers(), rollout=NoWorkers(), agent_loops=loops, tokenizer=None,
                         train_data=data, val_data=None, reward=reward, critic=None, store=store)
    trainer = PPOTrainer(OmegaConf.to_object(cfg), parts)

    metrics = trainer.step()

    assert loops.rounds == ROUNDS and trainer.global_steps == 1
    assert metrics["train/skipped_step"] == 1.0 and metrics["buffer/evicted_groups"] == 2 * ROUNDS
    # no NaN mean of nothing (the reward error rates of the evicted rounds' samples are measured, so they stay)
    assert not any(key.startswith(("reward/", "actor/")) and not key.endswith("/error_rate") for key in metrics)
    assert len(store.deleted) == 2 * ROUNDS * N  # every evicted sample left the store
    assert "kept no prompt group in 3 generation rounds" in capsys.readouterr().out
