"""The load balancer's rules without Ray: least in-flight wins (ties to the first registered), a session sticks
to its server whatever the load, removal re-routes exactly the removed server's sessions, and late releases from
a removed server are harmless; the batched calls that clients coalesce bursts into decide exactly like one call
per request."""

from __future__ import annotations

import pytest

from mrl.rollout.load_balancer import LoadBalancer


def test_new_requests_go_to_least_loaded_and_ties_to_first():
    lb = LoadBalancer({"a": "A", "b": "B", "c": "C"})
    assert lb.acquire("r1") == ("a", "A")
    assert [lb.acquire_id(r) for r in ("r2", "r3")] == ["b", "c"]
    assert lb.handle("b") == "B" and lb.handle("gone") is None
    lb.release("b")
    assert lb.acquire_id("r4") == "b"
    assert lb.in_flight() == {"a": 1, "b": 1, "c": 1}


def test_sessions_stick_even_to_a_busier_server():
    lb = LoadBalancer({"a": None, "b": None})
    assert lb.acquire_id("session") == "a"
    for i in range(3):
        lb.acquire(f"other{i}")
    assert lb.in_flight() == {"a": 2, "b": 2}
    lb.acquire("x")  # a: 3
    assert lb.acquire_id("session") == "a"
    assert lb.in_flight()["a"] == 4


def test_removal_reroutes_only_its_sessions():
    lb = LoadBalancer({"a": None, "b": None})
    lb.acquire("s-a")
    lb.acquire("s-b")
    assert sorted(lb.remove_server("a")) == ["s-a"]
    lb.release("a")  # the call that was running on the removed server returns late
    assert lb.acquire_id("s-a") == "b"
    assert lb.session_server("s-b") == "b"
    assert lb.remove_server("missing") == []


def test_forget_and_session_bound():
    lb = LoadBalancer({"a": None, "b": None}, max_sessions=2)
    lb.acquire("s1")
    lb.release("a")
    lb.forget("s1")
    assert lb.session_server("s1") is None
    for rid in ("s2", "s3", "s4"):
        lb.acquire(rid)
    assert lb.session_server("s2") is None and lb.session_server("s4") is not None


def test_errors_name_the_problem():
    lb = LoadBalancer()
    with pytest.raises(RuntimeError, match="no rollout server"):
        lb.acquire("r")
    lb.add_server("a")
    with pytest.raises(ValueError, match="already registered"):
        lb.add_server("a")


def test_batched_acquire_and_release_match_one_by_one():
    one, batched = LoadBalancer({"a": None, "b": None}), LoadBalancer({"a": None, "b": None})
    rids = ["s1", "s2", "s1", "s3", "s4"]
    assert batched.acquire_ids(rids) == [one.acquire_id(r) for r in rids] == ["a", "b", "a", "b", "a"]
    assert batched.in_flight() == one.in_flight() == {"a": 3, "b": 2}
    batched.remove_server("b")
    batched.release_ids(["a", "b", "a"])  # "b" was removed while its call ran: ignored
    assert batched.in_flight() == {"a": 1}
