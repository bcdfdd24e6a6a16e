"""Two replicas of a backend behind the global load balancer: a new request goes to the least loaded server, a
multi-turn session sticks to its server even when that server is busier, and removing a replica at run time
re-routes its sessions to the survivor (replicas are added and removed on the live manager)."""

from __future__ import annotations

import asyncio

import pytest
import ray
from rollout_fixtures import *  # noqa: F403  (the shared fixtures: managers, models)
from rollout_fixtures import PROMPT, run, wait_for

pytestmark = pytest.mark.integration

SHORT = {"temperature": 0, "max_tokens": 4}


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
