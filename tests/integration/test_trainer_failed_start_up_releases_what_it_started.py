"""A start-up that fails part-way (here: the training workers miss `resources.start_timeout_s` while the hybrid
replicas are launching) releases everything it had started: the workers, the replicas' servers and the pool's
placement groups. Left behind, they held their slots and names, and the next start-up in the same cluster failed
("placement group 'mrl_tiny_grpo_node0' already exists")."""

from __future__ import annotations

import time

import pytest
import ray
from ray.util.placement_group import placement_group_table
from trainer_fixtures import tiny_trainer

from mrl.controller import WorkerGroupStartTimeout
from mrl.trainer.ppo_trainer import PPOTrainer


def free_cpus() -> float:
    return ray.available_resources().get("CPU", 0.0)


def test_failed_start_up_releases_its_workers_replicas_and_slots(ray_cluster, tmp_path):
    before = free_cpus()
    overrides = ["trainer.experiment_name=failed_start", "resources.start_timeout_s=2"]
    with pytest.raises(WorkerGroupStartTimeout, match="within 2 s"):
        tiny_trainer(PPOTrainer, "tiny/grpo", tmp_path, overrides, list("abcd"), prompts=16)
    states = {pg["name"]: pg["state"] for pg in placement_group_table().values()}
    assert states["mrl_failed_start_node0"] == "REMOVED"
    deadline = time.monotonic() + 60  # killed actors hand their shares back asynchronously
    while free_cpus() < before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert free_cpus() >= before  # a previous test's shares may still have been on their way back
