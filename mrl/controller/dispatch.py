"""Plan one group call: which ranks run, with which arguments, and how their results are collected.

Pure logic, no transport: `WorkerGroup` executes the plan (on Ray actors) and `GroupFuture` applies its
collect step. Rules per dispatch mode:

* ONE_TO_ALL: the same arguments to every rank (rank 0 only under Execute.RANK_ZERO).
* ALL_TO_ALL: every argument is a list of world-size items; rank r gets item r of each.
* DP_COMPUTE and nd_compute: every data argument (see `splitting`) is cut into n equal chunks, n = the DP size;
  rank r gets chunk layout.chunk_of_rank[r]; non-data arguments go unchanged to every rank (pass a tuple, not a
  list, to send a sequence whole). All data arguments must have the same length L. If n does not divide L the
  call fails unless the method was registered with pad=True, in which case every data argument is padded by
  p = -L mod n rows and the concatenated result loses its last p rows. Only the collect ranks' results are kept
  (others return None, so TP/PP duplicates never travel); the result is their concatenation in DP order, or
  their list when they are not data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mrl.controller import splitting
from mrl.controller.decorator import Dispatch, Execute, RegisterSpec
from mrl.controller.future import CollectPlan, Gather, GroupFuture
from mrl.controller.mesh import DispatchLayout


@dataclass
class CallPlan:
    ranks: list[int]
    args: list[tuple[Any, ...]]
    kwargs: list[dict[str, Any]]
    keep: list[bool]  # whether rank ranks[i] must return its result (False: return None)
    collect: CollectPlan
    # Handles every called rank waits for before running: the uncollected ranks of forwarded futures. They hold
    # None (uncollected ranks drop their results), so waiting is cheap, and an error there fails this call
    # instead of vanishing with a future nobody calls get() on.
    after: list[Any] = field(default_factory=list)


def plan_call(
    method: str,
    spec: RegisterSpec,
    world_size: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    layout: DispatchLayout | None = None,
) -> CallPlan:
    """`layout` is needed for splitting modes (DispatchLayout.data_parallel(world_size) for DP_COMPUTE)."""
    if spec.splits_data:
        if layout is None:
            raise ValueError(f"{method}: a splitting dispatch mode needs a DispatchLayout")
        return _plan_split(method, spec, layout, args, kwargs)
    if spec.dispatch_mode is Dispatch.ALL_TO_ALL:
        return _plan_all_to_all(method, world_size, args, kwargs)
    ranks = [0] if spec.execute_mode is Execute.RANK_ZERO else list(range(world_size))
    after: list[Any] = []
    args = tuple(_gather_future(a, after) for a in args)
    kwargs = {k: _gather_future(v, after) for k, v in kwargs.items()}
    how = "single" if spec.execute_mode is Execute.RANK_ZERO else "list"
    n = len(ranks)
    return CallPlan(ranks, [args] * n, [kwargs] * n, [True] * n, CollectPlan(tuple(range(n)), how), after)


def _uncollected(future: GroupFuture) -> list[Any]:
    return [h for i, h in enumerate(future.handles) if i not in future.collect.indices]


def _gather_future(value: Any, after: list[Any]) -> Any:
    if not isinstance(value, GroupFuture):
        return value
    after.extend(_uncollected(value))
    return Gather.of(value)


def _plan_all_to_all(method: str, world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CallPlan:
    def per_rank(name: str, value: Any) -> list[Any]:
        if isinstance(value, GroupFuture):
            if value.collect.how == "list" and len(value.collect.indices) == world_size:
                return value.parts  # one result per rank: forward rank i's ref to rank i
            value = value.get()
        if not isinstance(value, list | tuple) or len(value) != world_size:
            got = f"{type(value).__name__} of {len(value)}" if isinstance(value, list | tuple) else type(value).__name__
            raise ValueError(
                f"{method} (ALL_TO_ALL): argument {name} must be a list with one item per rank "
                f"({world_size}), got {got}"
            )
        return list(value)

    pos = [per_rank(f"#{i}", a) for i, a in enumerate(args)]
    kw = {k: per_rank(repr(k), v) for k, v in kwargs.items()}
    ranks = list(range(world_size))
    return CallPlan(
        ranks,
        [tuple(p[r] for p in pos) for r in ranks],
        [{k: v[r] for k, v in kw.items()} for r in ranks],
        [True] * world_size,
        CollectPlan(tuple(ranks), "list"),
    )


def _divisibility_error(method: str, length: int, n: int) -> ValueError:
    return ValueError(
        f"{method}: batch size {length} is not divisible by the data-parallel size {n} "
        f"({length} = {length // n}×{n} + {length % n}). Training calls never get dispatch padding: make the "
        "batch divisible (the trainer adds no-op samples with an all-zero loss mask), or register a read-only "
        "method with pad=True."
    )


def _row_count(method: str, values: dict[str, Any]) -> int | None:
    """The common length of the data arguments in values (None without any)."""
    lengths = {name: splitting.data_len(v) for name, v in values.items() if splitting.is_data(v)}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{method}: data arguments must have the same number of rows, got {lengths}")
    return next(iter(lengths.values()), None)


def _padding(method: str, spec: RegisterSpec, length: int | None, n: int) -> int | None:
    pad = None if length is None else -length % n
    if pad and not spec.pad:
        raise _divisibility_error(method, length, n)
    return pad


def _plan_split(
    method: str, spec: RegisterSpec, layout: DispatchLayout, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> CallPlan:
    n = layout.n_chunks
    names = [f"#{i}" for i in range(len(args))] + [repr(k) for k in kwargs]
    values = dict(zip(names, [*args, *kwargs.values()]))
    pad = _padding(method, spec, _row_count(method, values), n)

    # A future is forwarded chunk-wise when its chunks line up with this call's: same count, same padding, and
    # padding only where this method accepts it. Otherwise the driver resolves it (see future.py).
    chunks: dict[str, list[Any]] = {}
    after: list[Any] = []
    for name, v in values.items():
        if not isinstance(v, GroupFuture):
            continue
        p = v.collect.pad_count
        if v.collect.how == "concat" and len(v.collect.indices) == n and (p == 0 or spec.pad) and pad in (None, p):
            chunks[name], pad = v.parts, p
            after.extend(_uncollected(v))
        else:
            values[name] = v.get()

    plain = {name: v for name, v in values.items() if name not in chunks}
    plain_pad = _padding(method, spec, _row_count(method, plain), n)
    if None not in (pad, plain_pad) and pad != plain_pad:
        raise ValueError(f"{method}: a forwarded future carries {pad} padded rows but the other data needs {plain_pad}")
    pad = plain_pad if pad is None else pad
    for name, v in plain.items():
        if splitting.is_data(v):
            padded, _ = splitting.pad_to_divisible(v, n) if pad else (v, 0)
            chunks[name] = splitting.split(padded, n)

    def for_chunk(c: int) -> list[Any]:
        return [chunks[name][c] if name in chunks else values[name] for name in names]

    per_rank = [for_chunk(c) for c in layout.chunk_of_rank]
    n_pos = len(args)
    collect_set = set(layout.collect_ranks)
    ranks = list(range(len(layout.chunk_of_rank)))
    return CallPlan(
        ranks,
        [tuple(v[:n_pos]) for v in per_rank],
        [dict(zip(kwargs, v[n_pos:])) for v in per_rank],
        [r in collect_set for r in ranks],
        CollectPlan(layout.collect_ranks, "concat", pad or 0),
        after,
    )
