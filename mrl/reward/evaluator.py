"""Batched, concurrent reward evaluation that never raises on one bad item and never blocks on it.

Each item is scored by the function registered for its `data_source` (or one function for all), in a thread or
process pool, at most `max_workers` at a time. Any failure (exception, non-numeric or non-finite score, pickling
error, timeout) scores 0.0 and is reported in `RewardResult.error`, which the trainer counts per data source
(mrl/reward/errors.py). A data_source without a registered function is a configuration error, not an item's:
`evaluate` raises it before scoring anything (the start-up rules refuse it first where the data files are read).
The timeout of an item counts from the moment
it starts running, not from submission, so a large batch does not time out in the queue.

A call that times out cannot be interrupted from outside: the evaluator then swaps in a fresh pool so the stuck
worker does not hold a slot. With `executor="process"` the old pool's worker processes are also terminated (the
only way to stop a hung call), and items that were running in that pool are retried once in the new one. With
threads the stuck thread is abandoned (it ends when its call returns, and interpreter exit waits for it), so
prefer processes for untrusted or possibly slow reward code, threads for the cheap rule functions (no start-up
cost).

Off the training loop: `submit(items)` returns a `concurrent.futures.Future` evaluated on the evaluator's own
event-loop thread; `await evaluate(items)` serves callers that already run a loop (agent loops).
"""

import asyncio
import math
import multiprocessing
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from mrl.reward.registry import RewardFn, resolve_reward_fn


@dataclass(frozen=True)
class RewardItem:
    solution_str: Any
    ground_truth: Any
    data_source: str | None = None
    extra_info: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class RewardResult:
    """`extra`: the other entries when the function returned a dict (e.g. {"score": 1.0, "acc": 1.0}), for metrics."""

    score: float
    error: str | None = None
    extra: Mapping[str, Any] | None = None


def score_item(fn: RewardFn, item: RewardItem) -> RewardResult:
    """fn(solution_str, ground_truth, extra_info) — a number, or a dict with a "score" entry — as a finite float,
    or 0.0 with the reason; never raises."""
    try:
        if not isinstance(item.solution_str, str):
            return RewardResult(0.0, f"solution is {type(item.solution_str).__name__}, not str")
        value = fn(item.solution_str, item.ground_truth, item.extra_info)
        extra = None
        if isinstance(value, Mapping):
            extra = {k: v for k, v in value.items() if k != "score"}
            value = value["score"]
        score = float(value)
    except Exception as err:  # a reward function's bug must cost one sample's reward, not the run
        return RewardResult(0.0, f"{type(err).__name__}: {err}")
    if not math.isfinite(score):
        return RewardResult(0.0, f"non-finite score {score}")
    return RewardResult(score, extra=extra)


class RewardEvaluator:
    def __init__(
        self,
        reward_fn: str | RewardFn | None = None,
        *,
        max_workers: int = 4,
        timeout_s: float = 10.0,
        executor: str = "thread",
    ) -> None:
        """`reward_fn`: one function (or "module:function" / a data_source name) for every item; None picks by each
        item's data_source. `executor`: "thread" or "process" (spawned workers)."""
        if executor not in ("thread", "process"):
            raise ValueError(f"reward executor must be 'thread' or 'process', got '{executor}'")
        if max_workers < 1 or timeout_s <= 0:
            raise ValueError("reward evaluator needs max_workers >= 1 and timeout_s > 0")
        self._fixed_fn = resolve_reward_fn(reward_fn) if isinstance(reward_fn, str) else reward_fn
        self.max_workers = max_workers
        self.timeout_s = timeout_s
        self.executor_kind = executor
        self._pool_lock = threading.Lock()
        self._pool, self._ready = self._new_pool()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None

    def _new_pool(self) -> tuple[Executor, list["Future[int]"]]:
        """A pool and the futures that say its workers have started (none needed for threads)."""
        if self.executor_kind == "thread":
            return ThreadPoolExecutor(self.max_workers, thread_name_prefix="mrl-reward"), []
        # spawn, not fork: the trainer process holds threads (Ray, torch) that a fork would copy mid-state.
        pool = ProcessPoolExecutor(self.max_workers, mp_context=multiprocessing.get_context("spawn"))
        # Start every worker now; items wait for them untimed, since interpreter start-up on a loaded machine can
        # take seconds that must not count against an item's timeout.
        return pool, [pool.submit(os.getpid) for _ in range(self.max_workers)]

    def _recycle(self, stuck: Executor) -> None:
        """Replace `stuck` (once, however many items noticed it) and stop its workers where that is possible."""
        with self._pool_lock:
            if self._pool is not stuck:
                return
            self._pool, self._ready = self._new_pool()
        if isinstance(stuck, ProcessPoolExecutor):
            if hasattr(stuck, "terminate_workers"):  # Python ≥ 3.14
                stuck.terminate_workers()
            else:
                # 3.11–3.13 have no public way to stop a worker in the middle of a call; the process table must be
                # read before shutdown(), which drops it.
                for process in list((getattr(stuck, "_processes", None) or {}).values()):
                    process.terminate()
        stuck.shutdown(wait=False, cancel_futures=True)

    def _fn_for(self, item: RewardItem) -> RewardFn:
        return self._fixed_fn if self._fixed_fn is not None else resolve_reward_fn(item.data_source)

    async def _score_one(self, fn: RewardFn, item: RewardItem, slots: asyncio.Semaphore) -> RewardResult:
        loop = asyncio.get_running_loop()
        async with slots:
            for _ in range(2):
                pool, ready = self._pool, self._ready
                try:
                    if ready:
                        await asyncio.gather(*(asyncio.wrap_future(started) for started in ready))
                    return await asyncio.wait_for(loop.run_in_executor(pool, score_item, fn, item), self.timeout_s)
                except TimeoutError:
                    self._recycle(pool)
                    return RewardResult(0.0, f"timeout after {self.timeout_s} s")
                except (BrokenProcessPool, RuntimeError):
                    # Another item's timeout terminated this pool under us (RuntimeError: submitted after shutdown).
                    self._recycle(pool)
                except Exception as err:  # e.g. the function or item cannot be pickled for a process pool
                    return RewardResult(0.0, f"{type(err).__name__}: {err}")
            return RewardResult(0.0, "reward worker pool failed twice")

    async def evaluate(self, items: Sequence[RewardItem]) -> list[RewardResult]:
        """Score every item concurrently (at most max_workers running); results in input order. Raises
        `UnknownDataSource` when an item's data_source has no reward function."""
        fns = [self._fn_for(item) for item in items]
        slots = asyncio.Semaphore(self.max_workers)
        return list(await asyncio.gather(*(self._score_one(fn, item, slots) for fn, item in zip(fns, items))))

    def submit(self, items: Sequence[RewardItem]) -> "Future[list[RewardResult]]":
        """Start evaluating in the background and return at once; `.result()` blocks for the scores."""
        with self._pool_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._loop_thread = threading.Thread(target=self._loop.run_forever, name="mrl-reward-loop", daemon=True)
                self._loop_thread.start()
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(self.evaluate(list(items)), loop)

    def evaluate_sync(self, items: Sequence[RewardItem]) -> list[RewardResult]:
        return self.submit(items).result()

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(timeout=5)
            self._loop.close()
            self._loop = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "RewardEvaluator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
