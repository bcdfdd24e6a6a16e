"""Futures of non-blocking group calls, and the marker that lets a worker resolve one itself.

A `GroupFuture` holds one handle per called rank (a Ray ObjectRef on a Ray group) plus the plan that turns the
handles' values into the group result. Passed as an argument to a later group call it is resolved without the
user calling `ray.get`; how depends on the later call (see `dispatch.plan_call`):

* same number of DP chunks and compatible padding: each rank receives the ObjectRef of its chunk as a top-level
  argument, which Ray resolves inside the worker — the data never goes through the driver;
* ONE_TO_ALL / RANK_ZERO: every rank receives a `Gather` of all collected refs and combines them itself;
* ALL_TO_ALL from a future holding one result per rank: rank i receives the ref of result i;
* anything else (re-chunking to another DP size, different padding): the driver resolves the future and splits
  its value like plain data — one round trip through the driver.

The later call also waits for the future's uncollected ranks (they return None, so this costs no transfer):
an error on any rank of the earlier call fails the later one rather than being lost.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from mrl.controller import splitting

CollectHow = Literal["list", "concat", "single"]


@dataclass(frozen=True)
class CollectPlan:
    """indices: positions (in the called-ranks list) of the results that form the group result, in order.

    how: "list" → the list of those results; "concat" → their concatenation with the last `pad_count` rows
    removed (a list in DP order when the results are not data); "single" → the one result.
    """

    indices: tuple[int, ...]
    how: CollectHow
    pad_count: int = 0


def combine(plan: CollectPlan, parts: list[Any]) -> Any:
    """Apply `plan` to the values of the collected results (already in plan order)."""
    if plan.how == "single":
        return parts[0]
    if plan.how == "list":
        return list(parts)
    if splitting.can_concat(parts):
        return splitting.unpad(splitting.concat(parts), plan.pad_count)
    if plan.pad_count:
        kinds = sorted({type(p).__name__ for p in parts})
        raise TypeError(f"cannot strip {plan.pad_count} dispatch-padded rows from results of type(s) {kinds}")
    return list(parts)


def fetch(handles: list[Any]) -> list[Any]:
    """Values of handles that may be Ray ObjectRefs (fetched in one call) or plain values (kept)."""
    import ray

    refs = [h for h in handles if isinstance(h, ray.ObjectRef)]
    values = iter(ray.get(refs)) if refs else iter(())
    return [next(values) if isinstance(h, ray.ObjectRef) else h for h in handles]


class GroupFuture:
    """The pending result of a non-blocking group call. `get()` waits for every called rank, so an error on any
    rank surfaces, and returns the collected result (cached)."""

    def __init__(self, handles: list[Any], collect: CollectPlan, resolve: Callable[[list[Any]], list[Any]]):
        self.handles = handles
        self.collect = collect
        self._resolve = resolve
        self._done = False
        self._value: Any = None

    @property
    def parts(self) -> list[Any]:
        """Handles of the collected results, in collect order."""
        return [self.handles[i] for i in self.collect.indices]

    def get(self) -> Any:
        if not self._done:
            values = self._resolve(self.handles)
            self._value = combine(self.collect, [values[i] for i in self.collect.indices])
            self._done = True
        return self._value

    def __reduce__(self) -> Any:
        # Reached when a future is nested inside another argument (a list, a dict): only top-level arguments of a
        # group call are resolved, and pickling would drag the whole group along.
        raise TypeError(
            "a GroupFuture can only be passed as a top-level argument of a group call; call .get() to use its value"
        )

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"GroupFuture({len(self.handles)} ranks, collect={self.collect.how}, {state})"


@dataclass(frozen=True)
class Gather:
    """A future's collected parts sent to a worker, which fetches and combines them itself (`Worker` resolves
    every `Gather` argument before calling the method)."""

    parts: tuple[Any, ...]
    collect: CollectPlan

    @classmethod
    def of(cls, future: GroupFuture) -> Gather:
        plan = CollectPlan(tuple(range(len(future.collect.indices))), future.collect.how, future.collect.pad_count)
        return cls(tuple(future.parts), plan)

    def resolve(self) -> Any:
        return combine(self.collect, fetch(list(self.parts)))
