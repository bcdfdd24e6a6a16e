"""`RolloutProducer`: keeps the rollout replicas generating from a background thread and feeds the replay buffer,
for the async trainer modes (colocate_async, separate_async).

One prompt group (the `n` sessions of one prompt) is the unit: it is submitted to the agent loops on its own, and
scored and added to the buffer when its last trajectory ends, so the trainer takes the groups that finished first.

Admission bounds the off-policyness before any work is spent (AReaL's rule): a group may start only while

    consumed + buffered + in flight < (version + staleness_threshold + 1) × groups_per_step

with `version` the weights the replicas now hold. Every group started under version v is then among the first
(v + s + 1) × B groups the trainer takes, so it trains at a version ≤ v + s: staleness ≤ s. Groups that finish
out of order can still exceed it; the buffer drops those (`ReplayBuffer.drop_stale`). With s = 0 the producer
waits for each sync: synchronous training with the async machinery.

State for checkpoints (with the dataloader position, which counts every prompt drawn, and the replay buffer, which
the trainer saves): the prompts drawn but neither finished nor trained on (in flight, or not yet submitted) are
listed by `state_dict()`; `load_state_dict` re-issues them first after a resume (their partial tokens are lost:
they regenerate on the restored weights).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import ray

from mrl.data.replay_buffer import ReplayBuffer

Prompt = dict[str, Any]


def may_start(consumed: int, buffered: int, in_flight: int, version: int, staleness_threshold: int,
              groups_per_step: int) -> bool:
    """The admission rule above, on group counts."""
    return consumed + buffered + in_flight < (version + staleness_threshold + 1) * groups_per_step


class RolloutProducer:
    def __init__(
        self,
        submit: Callable[[Prompt, int], ray.ObjectRef],
        score: Callable[[list[dict[str, Any]], list[Prompt]], None],
        prompts: Iterator[list[Prompt]],
        buffer: ReplayBuffer,
        n: int,
        groups_per_step: int,
        staleness_threshold: int,
        max_evictions_per_step: int | None = None,
        group_timeout_s: float | None = None,
    ) -> None:
        """`submit(prompt, index)` starts one group (index: a running count, for seeds) and returns the ref of its
        trajectories; `score(trajectories, [prompt])` sets each trajectory's `score`. `max_evictions_per_step`:
        with dynamic sampling, a step takes a short batch once this many groups were evicted since the previous
        step took its groups (the sync trainer's max_sample_rounds bound), instead of waiting forever on a task that
        is solved.
        `group_timeout_s` (rollout.generate_timeout_s): a group still unfinished after it fails the run, naming the
        knob, rather than leaving the trainer waiting on it."""
        self.submit, self.score, self.prompts, self.buffer = submit, score, prompts, buffer
        self.n, self.groups_per_step, self.staleness_threshold = n, groups_per_step, staleness_threshold
        self.max_evictions_per_step, self.group_timeout_s = max_evictions_per_step, group_timeout_s
        self.version = 0
        self.consumed = 0
        self.started = 0
        self._evicted_at_last_take = 0
        self._pending: deque[Prompt] = deque()  # drawn from the dataset (or re-issued), not yet submitted
        # ref -> (dataset row, submitted prompt, start time)
        self._in_flight: dict[ray.ObjectRef, tuple[Prompt, Prompt, float]] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # ---- trainer side ---------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def set_version(self, version: int) -> None:
        """The replicas now hold `version`: admission widens by one step's groups."""
        with self._cond:
            self.version = version
            self._cond.notify_all()

    def take(self, num_groups: int, current_version: int, poll_s: float = 0.5) -> list[dict[str, Any]]:
        """Wait until `num_groups` groups not staler than the threshold are buffered; take them (oldest first)."""
        with self._cond:
            while True:
                if self._error is not None:
                    raise RuntimeError("the rollout producer failed") from self._error
                self.buffer.drop_stale(current_version)
                short = (self.max_evictions_per_step is not None and len(self.buffer) > 0
                         and self.buffer.evicted - self._evicted_at_last_take >= self.max_evictions_per_step)
                if self.buffer.ready(num_groups) or short:
                    taken = self.buffer.sample(min(num_groups, len(self.buffer)))
                    self.consumed += len(taken) // self.n
                    self._evicted_at_last_take = self.buffer.evicted
                    self._cond.notify_all()
                    return taken
                self._cond.wait(poll_s)

    def stats(self) -> dict[str, float]:
        with self._cond:
            return {"producer/in_flight_groups": float(len(self._in_flight)),
                    "producer/buffered_groups": float(len(self.buffer)),
                    "producer/started_groups": float(self.started),
                    "staleness/dropped_groups": float(self.buffer.dropped_stale)}

    @property
    def lock(self) -> threading.Condition:
        """Held, the producer thread neither draws prompts nor changes the buffer (re-entrant)."""
        return self._cond

    def state_dict(self) -> dict[str, Any]:
        """The prompts drawn but not finished (in flight, pending): re-issued after a resume."""
        with self._cond:
            rows = [*(row for row, _, _ in self._in_flight.values()), *self._pending]
            return {"reissue": [dict(r) for r in rows], "started": self.started}

    def load_state_dict(self, state: dict[str, Any], version: int) -> None:
        """Re-issue the saved prompts before drawing new ones; admission restarts from `version`."""
        with self._cond:
            self._pending.extendleft(reversed([dict(r) for r in state.get("reissue", [])]))
            self.started = state.get("started", 0)  # sampling seeds follow it: no replayed seeds after a resume
            self.version = version
            self.consumed = version * self.groups_per_step
            self._evicted_at_last_take = self.buffer.evicted  # the restored buffer's count: no budget spent yet
            self._cond.notify_all()

    # ---- producer thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._fill()
                refs = list(self._in_flight)
                if not refs:
                    with self._cond:
                        self._cond.wait(0.2)
                    continue
                ready, _ = ray.wait(refs, num_returns=1, timeout=0.2)
                if ready:  # everything else that finished meanwhile too
                    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                for ref in ready:
                    self._collect(ref)
                self._check_overdue()
        except BaseException as error:  # the trainer thread re-raises it from take()
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _fill(self) -> None:
        with self._cond:
            while not self._stop.is_set() and may_start(self.consumed, len(self.buffer), len(self._in_flight),
                                                        self.version, self.staleness_threshold,
                                                        self.groups_per_step):
                if not self._pending:
                    self._pending.extend(next(self.prompts))
                row = self._pending.popleft()
                prompt = {**row, "uid": f"{row['uid']}@{uuid.uuid4().hex[:8]}"}
                self._in_flight[self.submit(prompt, self.started)] = (row, prompt, time.monotonic())
                self.started += 1

    def _collect(self, ref: ray.ObjectRef) -> None:
        trajectories = ray.get(ref)
        _, prompt, _ = self._in_flight[ref]
        self.score(trajectories, [prompt])  # also stamps each trajectory with the prompt's uid
        with self._cond:
            del self._in_flight[ref]
            self.buffer.add(trajectories, self.n)
            self._cond.notify_all()

    def _check_overdue(self) -> None:
        if self.group_timeout_s is None:
            return
        with self._cond:
            now = time.monotonic()
            late = [p["uid"] for _, p, start in self._in_flight.values() if now - start > self.group_timeout_s]
        if late:
            raise TimeoutError(f"rollout groups {late} did not finish within {self.group_timeout_s:g} s "
                               "(rollout.generate_timeout_s)")
