"""Trainer settings that cannot run fail at load time, naming the setting."""

import pytest

from mrl.config import ConfigError
from mrl.config.startup.loader import load_config

VALID = ["model.path=unused"]


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [
        (["algorithm.adv_estimator=gae"], "algorithm.adv_estimator"),
        (["critic.enable=true", "critic.ppo_mini_batch_size=5", "algorithm.adv_estimator=gae"],
         "critic.ppo_mini_batch_size"),
        (["rollout.num_replicas=2"], "rollout.num_replicas"),
        (["rollout.agent_loop=react"], "rollout.agent_loop"),
        (["data.max_sample_rounds=0"], "data.max_sample_rounds"),
    ],
)
def test_bad_trainer_setting_is_named(overrides, setting):
    with pytest.raises(ConfigError) as err:
        load_config("tiny/grpo", VALID + overrides, check_paths=False)
    assert setting in str(err.value)


def test_ppo_with_critic_and_one_hybrid_replica_is_valid():
    cfg = load_config("tiny/grpo", VALID + ["critic.enable=true", "algorithm.adv_estimator=gae",
                                            "rollout.num_replicas=1", "rollout.agent_loop=tool"], check_paths=False)
    assert cfg.critic.enable and cfg.rollout.num_replicas == 1
