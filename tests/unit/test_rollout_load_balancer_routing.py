"""The load balancer's rules without Ray: least in-flight wins (ties to the first registered), a session sticks
to its server whatever the load, removal re-routes exactly the removed server's sessions, and late releases from
a removed server are harmless; the reports in which clients send their own routing decisions keep the same
record of calls in flight and sessions as routing here would, and every change of membership moves the epoch."""

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


def test_client_reports_keep_the_record_and_membership_moves_the_epoch():
    local, record = LoadBalancer({"a": None, "b": None}), LoadBalancer({"a": None, "b": None})
    rids = ["s1", "s2", "s1", "s3", "s4"]
    decided = [(rid, local.acquire_id(rid)) for rid in rids]
    assert [sid for _, sid in decided] == ["a", "b", "a", "b", "a"]
    epoch, _ = record.view()
    assert record.report(decided, []) == epoch
    assert record.in_flight() == local.in_flight() == {"a": 3, "b": 2}
    assert record.session_server("s2") == "b" and record.acquire_id("s3") == "b"  # sticky as reported
    record.remove_server("b")
    assert record.view() == (epoch + 1, {"a": None})
    # "b" was removed while its calls ran: their releases, and a late decision for it, are ignored.
    assert record.report([("s5", "b")], ["a", "b", "a"]) == epoch + 1
    assert record.in_flight() == {"a": 1} and record.session_server("s5") is None
    record.add_server("c")
    assert record.view()[0] == epoch + 2
