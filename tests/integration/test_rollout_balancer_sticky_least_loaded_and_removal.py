"""Two replicas of a backend behind the global load balancer: a new request goes to the least loaded server, a
multi-turn session sticks to its server even when that server is busier, and removing a replica at run time
re-routes its sessions to the survivor (replicas are added and removed on the live manager), and the balancer
actor keeps the record of calls in flight and sessions. A client routes a burst itself, one call at a time in call
order by the same rules, and reports it to the balancer in one message for the starts and one for the ends; a
new event loop fetches the server set once."""

from __future__ import annotations

import asyncio

import pytest
import ray
from rollout_fixtures import *  # noqa: F403  (the shared fixtures: managers, models)
from rollout_fixtures import PROMPT, run, wait_for

from mrl.rollout.client import LLMServerClient
from mrl.rollout.load_balancer import LoadBalancer

pytestmark = pytest.mark.integration

SHORT = {"temperature": 0, "max_tokens": 4}


# Routing is the balancer's and the client's, the same for every backend: the hf replicas (5 s to add one) prove it;
# vLLM's own in-flight accounting is the replica tests' (a second vLLM replica cost 37 s here).
@pytest.mark.parametrize("manager", ["hf"], indirect=True)
def test_sticky_sessions_least_loaded_and_removal(manager):
    (first_rank,) = manager.replicas
    (second_rank,) = manager.add_replicas(1)
    first, second = manager.replicas[first_rank], manager.replicas[second_rank]
    pids = {rank: ray.get(r.health())["pid"] for rank, r in manager.replicas.items()}
    client = manager.client()
    balancer = manager.balancer

    async def scenario():
        turn1 = await client.generate("session-A", PROMPT, SHORT)
        assert turn1.extra["server_pid"] == pids[first_rank], "ties go to the server registered first"
        # Occupy the first server, then a new session must go to the idle second one.
        busy = asyncio.create_task(client.generate("busy", PROMPT, {"max_tokens": 2000, "ignore_eos": True, "seed": 0}))
        await wait_for(first, "in_flight", 1)
        assert await balancer.in_flight.remote() == {first.server_id: 1, second.server_id: 0}
        fresh = await client.generate("session-B", PROMPT, SHORT)
        assert fresh.extra["server_pid"] == pids[second_rank]
        # Turn 2 of session A goes back to its (busier) server.
        turn2 = await client.generate("session-A", PROMPT + turn1.token_ids + [7], SHORT)
        assert turn2.extra["server_pid"] == pids[first_rank]
        assert (await busy).extra["server_pid"] == pids[first_rank]
        return turn2

    turn2 = run(scenario())
    orphans = manager.remove_replica(first_rank)
    assert "session-A" in orphans and "session-B" not in orphans
    assert ray.get(balancer.servers.remote()) == [second.server_id]
    turn3 = run(client.generate("session-A", PROMPT + turn2.token_ids, SHORT))
    assert turn3.extra["server_pid"] == pids[second_rank]
    assert ray.get(balancer.session_server.remote("session-A")) == second.server_id


class CountingBalancer(LoadBalancer):
    """The real balancer, counting the routing RPCs it receives."""

    def __init__(self) -> None:
        super().__init__({"a": None, "b": None})
        self.rpcs = 0

    def view(self) -> tuple[int, dict]:
        self.rpcs += 1
        return super().view()

    def report(self, acquired: list[tuple[str, str]], released: list[str]) -> int:
        self.rpcs += 1
        return super().report(acquired, released)

    def rpc_count(self) -> int:
        return self.rpcs


def test_client_routes_a_burst_itself_and_reports_it_in_few_balancer_calls(ray_cluster):
    balancer = ray.remote(CountingBalancer).remote()
    client = LLMServerClient(balancer)

    async def burst(rids):
        ids = await asyncio.gather(*(client._acquire(rid) for rid in rids))
        assert await balancer.in_flight.remote() == {"a": ids.count("a"), "b": ids.count("b")}
        for server_id in ids:
            client._release(server_id)
        return ids

    rids = [f"r{i}" for i in range(16)]
    assert run(burst(rids)) == ["a", "b"] * 8  # least loaded, decided one at a time in call order
    assert ray.get(balancer.in_flight.remote()) == {"a": 0, "b": 0}
    assert ray.get(balancer.rpc_count.remote()) == 3  # the server set, one report of starts, one of ends
    # A new event loop (one asyncio.run per step): sessions stay sticky, new ones are routed least loaded.
    assert run(burst(["r1", "new", "r0"])) == ["b", "a", "a"]
    assert ray.get(balancer.in_flight.remote()) == {"a": 0, "b": 0}
    ray.kill(balancer)
