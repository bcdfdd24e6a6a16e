"""The round barrier of rollout_adapters/forwarding.py (SGLang / TensorRT-LLM receivers), with real threads.

Proves: bucket k of every rank goes out in one call, rank j's at index j; a rank whose stream ended adds empty
entries while the others go on; a failing forward or a failing rank wakes every waiting rank with the cause
instead of leaving it blocked; the (spec, rank) pairs follow the per-device list or number the one sender's ranks.
"""

from __future__ import annotations

import threading

import pytest
import torch

from rollout_adapters.forwarding import RoundBarrier, worker_pairs


def _run(barrier: RoundBarrier, streams: list[list[str]], fail_rank: int | None = None) -> list[BaseException | None]:
    errors: list[BaseException | None] = [None] * len(streams)

    def rank(r: int) -> None:
        try:
            for name in streams[r]:
                barrier.deliver(r, [(name, torch.zeros(1))])
            if r == fail_rank:
                raise OSError("transport broke")
        except BaseException as error:
            errors[r] = error
            barrier.leave(r, error)
            return
        barrier.leave(r)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "a rank was left waiting"
    return errors


def test_each_round_carries_every_ranks_bucket_and_empty_entries_after_a_short_stream():
    calls: list[list[list[str]]] = []
    barrier = RoundBarrier(2, lambda per_rank: calls.append([[n for n, _ in named] for named in per_rank]))
    errors = _run(barrier, [["a0", "a1"], ["b0", "b1", "b2", "b3"]])
    assert errors == [None, None]
    assert calls == [[["a0"], ["b0"]], [["a1"], ["b1"]], [[], ["b2"]], [[], ["b3"]]]


def test_a_failing_forward_reaches_every_rank():
    def forward(per_rank):
        raise RuntimeError("engine refused the bucket")

    errors = _run(RoundBarrier(3, forward), [["x"], ["y"], ["z"]])
    assert all(isinstance(e, RuntimeError) and "engine refused the bucket" in str(e) for e in errors)


def test_a_failing_rank_releases_the_ranks_waiting_on_it():
    calls = []
    barrier = RoundBarrier(2, calls.append)
    # Rank 1 delivers once and fails before its second bucket; rank 0 waits in round 2 and must be woken.
    errors = _run(barrier, [["a0", "a1", "a2"], ["b0"]], fail_rank=1)
    assert isinstance(errors[1], OSError) and "transport broke" in str(errors[0]) and len(calls) == 1


def test_pairs_follow_the_per_device_list_or_number_the_senders_ranks():
    spec = {"transport": "nccl"}
    assert worker_pairs(spec, 3, 2) == [(spec, 3), (spec, 4)]
    per_device = [({"transport": "ipc", "gpu": "a"}, 1), ({"transport": "ipc", "gpu": "b"}, 2)]
    assert worker_pairs(per_device, 0, 2) == per_device
    with pytest.raises(ValueError, match="2 \\(spec, rank\\) pairs for an engine of 4 workers"):
        worker_pairs(per_device, 0, 4)
