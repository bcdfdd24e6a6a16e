"""The batched evaluator: concurrent, in input order, 0 with a reason for every failure, timeouts that free the slot.

No torch import here: the process-pool test's spawned workers import this module to find its reward functions.
"""

import asyncio
import math
import time
from collections.abc import Mapping
from typing import Any

import pytest

from mrl.reward.evaluator import RewardEvaluator, RewardItem, RewardResult


def sleepy_reward(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    time.sleep(float(extra_info["sleep"]) if extra_info else 0.0)
    return 1.0 if solution_str == ground_truth else 0.0


def spinning_reward(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    if solution_str == "hang":
        while True:  # a pure-Python hang that only terminating the worker process can stop
            pass
    return 1.0 if solution_str == ground_truth else 0.0


def test_scores_by_data_source_and_malformed_items_score_zero():
    def raising(solution_str, ground_truth, extra_info=None):
        raise RuntimeError("bug in a user reward")

    items = [
        RewardItem("#### 72", "72", "openai/gsm8k"),
        RewardItem("the answer is 72", "72", "openai/gsm8k"),
        RewardItem("the answer is 72", "72", "default"),
        RewardItem(None, "72"),
        RewardItem(12345, "72"),
        RewardItem("\\boxed{1/2}", {"weird": "truth"}),
        RewardItem("\\boxed{", None),
    ]
    with RewardEvaluator(max_workers=2, timeout_s=5.0) as evaluator:
        results = evaluator.evaluate_sync(items)
    assert [r.score for r in results] == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert results[0].error is None and "not str" in results[3].error

    def nan_reward(solution_str, ground_truth, extra_info=None):
        return math.nan

    def text_reward(solution_str, ground_truth, extra_info=None):
        return "high"

    def dict_reward(solution_str, ground_truth, extra_info=None):
        return {"score": 0.5, "acc": 1.0}

    def dict_without_score(solution_str, ground_truth, extra_info=None):
        return {"acc": 1.0}

    with RewardEvaluator(dict_reward) as evaluator:
        assert evaluator.evaluate_sync([RewardItem("x", "x")]) == [RewardResult(0.5, extra={"acc": 1.0})]

    failing = [
        (raising, "RuntimeError: bug"),
        (nan_reward, "non-finite"),
        (text_reward, "ValueError"),
        (dict_without_score, "KeyError"),
    ]
    for fn, message in failing:
        with RewardEvaluator(fn, max_workers=1) as evaluator:
            (result,) = evaluator.evaluate_sync([RewardItem("x", "x")])
        assert result.score == 0.0 and message in result.error


def test_timeout_counts_from_start_and_a_stuck_item_does_not_hold_its_slot():
    # 6 items of 0.3 s on 2 workers take ~0.9 s: with the timeout counted from submission the last ones would fail.
    queued = [RewardItem("a", "a", extra_info={"sleep": 0.3}) for _ in range(6)]
    stuck = RewardItem("b", "b", extra_info={"sleep": 3.0})
    with RewardEvaluator(sleepy_reward, max_workers=2, timeout_s=0.6) as evaluator:
        assert [r.score for r in evaluator.evaluate_sync(queued)] == [1.0] * 6
        start = time.monotonic()
        results = evaluator.evaluate_sync([stuck, stuck, *queued])
        elapsed = time.monotonic() - start
    assert [r.score for r in results] == [0.0, 0.0] + [1.0] * 6
    assert all("timeout" in r.error for r in results[:2])
    # two 0.6 s timeouts, then the 6 short items in 3 waves on a fresh pool: far less than the 3 s of the stuck ones
    assert elapsed < 2.8, elapsed


def test_submit_returns_at_once_and_async_callers_can_await():
    with RewardEvaluator(sleepy_reward, max_workers=4, timeout_s=5.0) as evaluator:
        start = time.monotonic()
        future = evaluator.submit([RewardItem("a", "a", extra_info={"sleep": 0.5}) for _ in range(4)])
        assert time.monotonic() - start < 0.2 and not future.done()  # the training loop is free meanwhile
        assert [r.score for r in future.result(timeout=5)] == [1.0] * 4
        assert time.monotonic() - start < 1.5  # the four ran concurrently

    async def agent_loop(by_source: RewardEvaluator) -> list[RewardResult]:
        return await by_source.evaluate([RewardItem("<think>x</think> 4", "4", "think_math"), RewardItem("4", "5")])

    with RewardEvaluator() as by_source:
        assert asyncio.run(agent_loop(by_source)) == [RewardResult(1.0), RewardResult(0.0)]


def test_invalid_evaluator_settings_are_rejected():
    with pytest.raises(ValueError, match="'thread' or 'process'"):
        RewardEvaluator(executor="fiber")
    with pytest.raises(ValueError, match="timeout_s > 0"):
        RewardEvaluator(timeout_s=0)


def _running(pid: int) -> bool:
    """Whether the process exists and is not a zombie (read from /proc: the executor may reap it, not us)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.integration
def test_process_pool_terminates_a_hung_worker_and_keeps_scoring():
    items = [RewardItem("hang", "x"), RewardItem("7", "7"), RewardItem("8", "7")]
    with RewardEvaluator(spinning_reward, max_workers=2, timeout_s=2.0, executor="process") as evaluator:
        assert [r.score for r in evaluator.evaluate_sync(items[1:])] == [1.0, 0.0]  # workers spawned and warm
        first_pool = evaluator._pool
        workers = list(first_pool._processes.values())
        results = evaluator.evaluate_sync(items)
        assert [r.score for r in results] == [0.0, 1.0, 0.0]
        assert "timeout" in results[0].error
        assert evaluator._pool is not first_pool
        deadline = time.monotonic() + 5
        while any(_running(p.pid) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_running(p.pid) for p in workers)
        assert [r.score for r in evaluator.evaluate_sync(items[1:])] == [1.0, 0.0]
