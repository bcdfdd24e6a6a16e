"""The configuration root composes recipes with types checked, and start-up validation names setting and rule."""

import pytest
from hydra.errors import ConfigCompositionException

from mrl.config import ConfigError, load_config

VALID = ["model.path=unused"]


def _violations(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config("tiny/grpo", VALID + overrides, check_paths=False)
    return [v.setting for v in err.value.violations]


def test_tiny_recipe_composes_and_validates():
    cfg = load_config("tiny/grpo", VALID, check_paths=False)
    assert cfg.rollout.n == 4 and cfg.trainer.mode == "sync"
    assert cfg.trainer.default_local_dir == "runs/mrl/tiny_grpo"  # interpolation resolved at load


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [
        (["actor.ppo_mini_batch_size=5"], "actor.ppo_mini_batch_size"),
        (["trainer.mode=fastest"], "trainer.mode"),
        (["rollout.name=tgi"], "rollout.name"),
        (["weight_sync.transport=rdma"], "weight_sync.transport"),
        (["rollout.top_p=0"], "rollout.top_p"),
        (["rollout.top_k=0"], "rollout.top_k"),
        (["rollout.n=0"], "rollout.n"),
        (["resources.n_gpus_per_node=3", "actor.megatron.tensor_model_parallel_size=2"],
         "actor.megatron.tensor_model_parallel_size"),
        (["resources.n_gpus_per_node=2", "actor.megatron.expert_model_parallel_size=4"],
         "actor.megatron.expert_model_parallel_size"),
        (["actor.megatron.virtual_pipeline_model_parallel_size=2"],
         "actor.megatron.virtual_pipeline_model_parallel_size"),
        (["resources.n_gpus_per_node=2", "actor.megatron.context_parallel_size=2"],
         "actor.megatron.context_parallel_size"),
        (["rollout.mode=standalone", "weight_sync.transport=nccl"], "rollout.mode"),
        (["rollout.mode=standalone", "trainer.mode=separate_async", "rollout.nnodes=1", "rollout.n_gpus_per_node=1"],
         "weight_sync.transport"),
        (["model.path="], "model.path"),
        (["algorithm.use_kl_in_reward=true"], "algorithm.use_kl_in_reward"),
    ],
)
def test_each_invalid_setting_is_named(overrides, setting):
    assert setting in _violations(overrides)


def test_separate_async_constraints_reported_together():
    settings = _violations(["trainer.mode=separate_async"])
    assert {"rollout.mode", "rollout.nnodes", "rollout.n_gpus_per_node",
            "weight_sync.parameter_sync_step"} <= set(settings)


def test_separate_async_valid_when_constraints_hold():
    load_config("tiny/grpo", VALID + ["trainer.mode=separate_async", "rollout.mode=standalone", "rollout.nnodes=1",
                                      "rollout.n_gpus_per_node=1", "weight_sync.transport=nccl",
                                      "weight_sync.parameter_sync_step=2"], check_paths=False)


def test_message_names_setting_value_and_rule():
    with pytest.raises(ConfigError, match=r"actor\.ppo_mini_batch_size=5: must divide data\.train_batch_size=16"):
        load_config("tiny/grpo", [*VALID, "actor.ppo_mini_batch_size=5"], check_paths=False)


def test_unknown_key_and_wrong_type_fail_on_composition():
    with pytest.raises(ConfigCompositionException):
        load_config("tiny/grpo", ["rollout.nn=4"], check=False)
    with pytest.raises(ConfigCompositionException):
        load_config("tiny/grpo", ["rollout.n=four"], check=False)


def test_missing_model_folder_is_reported(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.path"):
        load_config("tiny/grpo", [f"model.path={tmp_path}"])


def test_unknown_recipe_lists_known_ones():
    with pytest.raises(FileNotFoundError, match=r"tiny/grpo"):
        load_config("tiny/nope")
