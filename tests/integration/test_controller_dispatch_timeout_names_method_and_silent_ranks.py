"""A group call whose worker sleeps past the group's time limit fails after that limit (blocking and through a
GroupFuture), naming the group, the method, the rank that did not answer and the config knob; a worker error on
another rank surfaces at once instead of after the limit; the group keeps serving calls afterwards."""

from __future__ import annotations

import time

import pytest

from mrl.controller import Dispatch, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, Worker, register
from mrl.controller.ray_worker_group import DispatchTimeoutError

pytestmark = pytest.mark.integration

LIMIT_S = 2.0


class SleepyWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def nap(self, rank: int, seconds: float) -> int:
        if self.rank == rank:
            time.sleep(seconds)
        return self.rank

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def nap_later(self, rank: int, seconds: float) -> int:
        return self.nap(rank, seconds)

    @register(Dispatch.ONE_TO_ALL)
    def fail_or_nap(self, failing: int, seconds: float) -> int:
        if self.rank == failing:
            raise ValueError(f"rank {self.rank} failed on purpose")
        time.sleep(seconds)
        return self.rank


@pytest.fixture(scope="module")
def group(ray_cluster):
    pool = RayResourcePool([2], use_gpu=False, name_prefix="dispatch_timeout")
    # Two calls may be in flight per worker: a napping rank still answers the next test's call.
    cls = RayClassWithInitArgs(SleepyWorker).update_options(max_concurrency=2)
    wg = RayWorkerGroup(pool, cls, name_prefix="sleepy", call_timeout_s=LIMIT_S)
    yield wg
    wg.kill()
    pool.remove()


def test_a_silent_rank_fails_the_call_naming_method_rank_and_knob(group):
    assert group.nap(-1, 0.0) == [0, 1]
    start = time.monotonic()
    with pytest.raises(DispatchTimeoutError) as info:
        group.nap(1, 30.0)
    waited = time.monotonic() - start
    message = str(info.value)
    assert "sleepy.nap" in message and "rank(s) [1] of 2" in message and "trainer.dispatch_timeout_s" in message
    assert "[0] did" in message
    assert LIMIT_S - 0.1 <= waited < LIMIT_S + 10  # ray.wait rounds its timeout


def test_a_future_of_a_silent_rank_times_out_on_get(group):
    future = group.nap_later(0, 30.0)
    with pytest.raises(DispatchTimeoutError, match=r"sleepy\.nap_later: rank\(s\) \[0\] of 2"):
        future.get()


def test_a_worker_error_surfaces_before_the_limit(group):
    group.call_timeout_s = 30.0  # room for a loaded machine's round trips; rank 1 naps past it
    try:
        start = time.monotonic()
        with pytest.raises(ValueError, match="rank 0 failed on purpose"):
            group.fail_or_nap(0, 60.0)
        assert time.monotonic() - start < 30.0
    finally:
        group.call_timeout_s = LIMIT_S
