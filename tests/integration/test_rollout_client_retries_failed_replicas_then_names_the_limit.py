"""The client's retry policy over the real load-balancer actor, with server actors that fail the way a dying
replica does (ConnectionError, as SGLang and TensorRT-LLM report a dead engine): a failed call is retried on
another server, which serves it, and the failed server is unregistered; when every attempt fails the error names
`rollout.max_request_retries`; with no server registered a call waits `rollout.request_retry_wait_s` and then
names it; a bad request (ValueError) is not retried and leaves its server registered."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from mrl.rollout.client import FaultPolicy, LLMServerClient, ReplicaFailureError
from mrl.rollout.load_balancer import LoadBalancer, NoServerError
from rollout_adapters.base import TokenOutput

pytestmark = pytest.mark.integration


@ray.remote(num_cpus=0)
class Server:
    def __init__(self, error: str | None) -> None:
        self.error, self.calls = error, 0

    def generate(self, request_id: str, prompt_ids: list[int], sampling: dict) -> TokenOutput:
        self.calls += 1
        if self.error == "dead":
            raise ConnectionError("engine dead")
        if self.error == "bad":
            raise ValueError("prompt too long")
        return TokenOutput([1, 2], [-0.5, -0.5], "stop", 3)

    def count(self) -> int:
        return self.calls


def pool(*errors: str | None):
    servers = {f"s{i}": Server.remote(e) for i, e in enumerate(errors)}
    return ray.remote(LoadBalancer).remote(servers), servers


def test_failed_call_is_retried_elsewhere_and_the_server_unregistered(ray_cluster):
    balancer, servers = pool("dead", None)
    client = LLMServerClient(balancer, FaultPolicy(max_request_retries=1))
    out = asyncio.run(client.generate("r", [5], {}))
    assert out.token_ids == [1, 2] and client.replica_failures == 1
    assert ray.get(balancer.servers.remote()) == ["s1"]
    assert ray.get([s.count.remote() for s in servers.values()]) == [1, 1]


def test_exhausted_retries_name_the_knob(ray_cluster):
    balancer, _ = pool("dead", "dead")
    client = LLMServerClient(balancer, FaultPolicy(max_request_retries=1, request_retry_wait_s=1.0))
    with pytest.raises(ReplicaFailureError, match=r"failed 2 times \(rollout.max_request_retries=1\)"):
        asyncio.run(client.generate("r", [5], {}))


def test_an_empty_pool_is_waited_for_then_named(ray_cluster):
    balancer, _ = pool()
    client = LLMServerClient(balancer, FaultPolicy(request_retry_wait_s=1.0))
    assert ray.get(balancer.servers.remote()) == []  # the actor is up: its start is not part of the wait
    start = time.monotonic()
    with pytest.raises(NoServerError, match=r"rollout.request_retry_wait_s=1 s"):
        asyncio.run(client.generate("r", [5], {}))
    assert 1.0 <= time.monotonic() - start < 30  # 1 s plus the polls' round trips on a loaded machine


def test_a_bad_request_is_not_retried(ray_cluster):
    balancer, servers = pool("bad", None)
    client = LLMServerClient(balancer, FaultPolicy(max_request_retries=3))
    with pytest.raises(ValueError, match="prompt too long"):
        asyncio.run(client.generate("r", [5], {}))
    assert client.replica_failures == 0 and ray.get(balancer.servers.remote()) == ["s0", "s1"]
    assert ray.get(servers["s0"].count.remote()) == 1
