"""The trainer's start-up overlaps its parts (mrl/trainer/build.py): `LLMServerManager.create(wait=False)` returns
while the engines start, with nothing registered yet, and `wait_started()` registers them and serves; agent-loop
workers start in the background and `wait_ready()` raises a worker's constructor error instead of leaving it to the
first generation round."""

from __future__ import annotations

import pytest
import ray
from rollout_fixtures import *  # noqa: F403  (the shared fixtures: the tiny model)
from rollout_fixtures import PROMPT, replica_spec, run

from mrl.rollout.agent_loop import AgentLoopManager
from mrl.rollout.manager import LLMServerManager

pytestmark = pytest.mark.integration


def test_replicas_register_at_wait_started_and_agent_loop_errors_surface_at_wait_ready(ray_cluster, tiny_model_dir):
    manager = LLMServerManager.create(replica_spec("hf", tiny_model_dir), "standalone", num_devices=1, wait=False)
    try:
        assert manager.replicas == {} and ray.get(manager.balancer.servers.remote()) == []
        broken = AgentLoopManager(1, "/nonexistent/tokenizer", manager.balancer)
        with pytest.raises(Exception, match="nonexistent"):
            broken.wait_ready()
        broken.shutdown()
        manager.wait_started()
        (replica,) = manager.replicas.values()
        assert ray.get(manager.balancer.servers.remote()) == [replica.server_id]
        out = run(manager.client().generate("s", PROMPT, {"temperature": 0, "max_tokens": 3}))
        assert len(out.token_ids) == 3
    finally:
        manager.shutdown()
