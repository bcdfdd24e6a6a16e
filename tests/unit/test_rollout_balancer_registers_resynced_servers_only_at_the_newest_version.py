"""The load balancer's part in replica failure, without Ray: a weight push records its version and gets exactly the
servers registered at that moment; a re-synced server registers only at the newest recorded version (so a push it
missed makes it re-sync first); a replacement that cannot be re-synced from a recorded copy receives the next
push before it is routed any request; an empty pool raises the error clients wait on; releases of a removed and
re-registered server never drive its count negative. The client tells a failed replica from a bad request."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from mrl.rollout.client import replica_failed
from mrl.rollout.load_balancer import LoadBalancer, NoServerError


def test_pushes_reach_the_registered_servers_and_registration_is_compare_and_set():
    lb = LoadBalancer({"a": "A"})
    assert lb.latest_weights() == (None, None)
    assert lb.add_server_at("b", "B", version=0)  # nothing pushed yet: the weights on disk are current
    assert lb.record_weights(5, ["ref5"]) == {"a": "A", "b": "B"}
    assert lb.latest_weights() == (5, ["ref5"])
    lb.remove_server("b")
    assert lb.record_weights(6, ["ref6"]) == {"a": "A"}  # b is down: it misses version 6
    assert not lb.add_server_at("b", "B2", version=5)  # re-synced to 5 meanwhile: refused, re-sync again
    assert lb.servers() == ["a"]
    assert lb.add_server_at("b", "B2", version=6)
    assert lb.handles() == {"a": "A", "b": "B2"}
    assert lb.add_server_at("b", "B2", version=6)  # idempotent


def test_a_pending_server_gets_pushes_but_no_requests_until_it_registers():
    lb = LoadBalancer({"a": "A"})
    lb.record_weights(3, None)  # a transport sent them: nothing to re-push from
    lb.add_pending("b", "B")
    assert lb.servers() == ["a"] and lb.acquire_id("r") == "a"
    assert lb.record_weights(4, None) == {"a": "A", "b": "B"}
    assert lb.add_server_at("b", "B", version=4)
    assert lb.record_weights(5, None) == {"a": "A", "b": "B"} and lb.servers() == ["a", "b"]
    lb.add_pending("c", "C")
    lb.remove_server("c")
    assert "c" not in lb.record_weights(6, None)


def test_empty_pool_raises_what_clients_wait_on_and_late_releases_floor_at_zero():
    lb = LoadBalancer()
    with pytest.raises(NoServerError):
        lb.acquire_id("r")
    lb.add_server("a")
    assert lb.acquire_id("r") == "a"
    lb.remove_server("a")
    lb.add_server("a")
    lb.release_ids(["a", "a"])  # the call that started before the removal ends now
    assert lb.in_flight() == {"a": 0}


def test_replica_failures_are_told_from_bad_requests():
    assert replica_failed(ActorDiedError())
    assert replica_failed(ConnectionError("sglang server unreachable"))
    wrapped = RayTaskError("generate", "traceback", ConnectionError("engine dead")).as_instanceof_cause()
    assert replica_failed(wrapped)

    class EngineDeadError(Exception):  # vLLM's name for a dead engine core
        pass

    assert replica_failed(RayTaskError("generate", "traceback", EngineDeadError()))
    assert not replica_failed(RayTaskError("generate", "tb", ValueError("prompt too long")).as_instanceof_cause())
    assert not replica_failed(ValueError("unknown sampling keys"))
