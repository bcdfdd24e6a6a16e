"""Each start-up rule of the async trainer modes, violated alone from a valid recipe, gives exactly its own error
naming the setting and the rule, and `mrl train` raises it before Ray or any worker starts."""

import pytest

from mrl.config.startup import ConfigError, load_config

VALID = ["model.path=unused"]  # tiny/grpo_separate_async: B = 16 = parameter_sync_step 2 × mini-batch 8


def test_the_async_tiny_recipes_are_valid():
    assert load_config("tiny/grpo_separate_async", VALID, check_paths=False).trainer.mode == "separate_async"
    assert load_config("tiny/grpo_colocate_async", VALID, check_paths=False).trainer.mode == "colocate_async"


@pytest.mark.parametrize(
    ("recipe", "override", "setting", "rule"),
    [
        ("tiny/grpo_separate_async", "rollout.mode=hybrid", "rollout.mode",
         "trainer.mode=separate_async needs rollout.mode=standalone"),
        ("tiny/grpo_separate_async", "rollout.nnodes=0", "rollout.nnodes", "rollout pool with device slots"),
        ("tiny/grpo_separate_async", "rollout.n_gpus_per_node=0", "rollout.n_gpus_per_node",
         "rollout pool with device slots"),
        ("tiny/grpo_separate_async", "weight_sync.transport=ipc", "weight_sync.transport",
         "syncs weights across pools: use nccl or disk, not ipc"),
        ("tiny/grpo_separate_async", "weight_sync.parameter_sync_step=3", "weight_sync.parameter_sync_step",
         "data.train_batch_size (16) == parameter_sync_step × actor.ppo_mini_batch_size (3 × 8)"),
        ("tiny/grpo_separate_async", "weight_sync.staleness_threshold=-1", "weight_sync.staleness_threshold",
         "must be >= 0"),
        ("tiny/grpo_colocate_async", "rollout.mode=colocated", "rollout.mode", "needs rollout.mode=hybrid"),
        ("tiny/grpo_colocate_async", "rollout.mode=standalone weight_sync.transport=disk", "rollout.mode",
         "a standalone rollout pool needs trainer.mode=separate_async"),
        ("tiny/grpo_colocate_async", "weight_sync.staleness_threshold=-2", "weight_sync.staleness_threshold",
         "must be >= 0"),
    ],
)
def test_each_violation_alone_gives_its_own_message(recipe, override, setting, rule):
    with pytest.raises(ConfigError) as err:
        load_config(recipe, ["model.path=unused", *override.split()], check_paths=False)
    assert [v.setting for v in err.value.violations] == [setting]
    assert rule in str(err.value) and f"{setting}=" in str(err.value)


def test_mrl_train_refuses_before_starting_ray(tmp_path, capsys):
    import ray

    from mrl.trainer.main import main

    (tmp_path / "config.json").write_text("{}")
    assert main(["tiny/grpo_separate_async", f"model.path={tmp_path}", "weight_sync.transport=ipc"]) == 2
    assert "mrl: weight_sync.transport='ipc'" in capsys.readouterr().err
    assert not ray.is_initialized()
