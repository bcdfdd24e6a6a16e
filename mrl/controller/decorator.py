"""`@register`: tag a worker method with how a group call reaches the workers.

The decorator only attaches a `RegisterSpec` to the function; nothing is wrapped, so the method behaves the same
when called directly inside the worker. `WorkerGroup` reads the tag and builds the group method
(split → call every worker → collect).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

SPEC_ATTR = "_mrl_register_spec"

F = TypeVar("F", bound=Callable[..., Any])


class Dispatch(enum.Enum):
    """How arguments are split over the workers and results collected.

    ONE_TO_ALL:  every worker gets the same arguments; the result is the list of per-rank results.
    ALL_TO_ALL:  every data argument is a list with one item per rank; the result is the list of per-rank results.
    DP_COMPUTE:  data arguments are cut into world-size contiguous chunks, chunk i to rank i; results are
                 concatenated in rank order.
    For a split along the DP axis of a device mesh use `nd_compute(mesh_name)`.
    """

    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    DP_COMPUTE = "dp_compute"


class Execute(enum.Enum):
    """Which ranks run the method: all of them, or only rank 0 (result returned bare, not as a list)."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class NDCompute:
    """Split along the data-parallel axis of the device mesh `mesh_name` that every worker registered."""

    mesh_name: str


def nd_compute(mesh_name: str) -> NDCompute:
    """Dispatch mode: chunk i goes to every rank of DP group i; collected from TP 0, CP 0, last PP stage."""
    return NDCompute(mesh_name)


DispatchMode = Dispatch | NDCompute


@dataclass(frozen=True)
class RegisterSpec:
    dispatch_mode: DispatchMode
    execute_mode: Execute
    blocking: bool
    # Dispatch padding is for read-only calls only (DESIGN.md): a training call must never see padded rows.
    pad: bool

    @property
    def splits_data(self) -> bool:
        return self.dispatch_mode is Dispatch.DP_COMPUTE or isinstance(self.dispatch_mode, NDCompute)


def register(
    dispatch_mode: DispatchMode = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    pad: bool = False,
) -> Callable[[F], F]:
    """Tag a worker method for `WorkerGroup` binding.

    `pad=True` lets DP_COMPUTE / nd_compute pad a batch whose size does not divide the DP size and strip the
    padded rows from the collected result (read-only calls: log-probs, values). Without it such a batch is an
    error. `blocking=False` makes the group method return a `GroupFuture`.
    """
    if not isinstance(dispatch_mode, Dispatch | NDCompute):
        raise TypeError(f"dispatch_mode must be a Dispatch or nd_compute(...), got {dispatch_mode!r}")
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"execute_mode must be an Execute, got {execute_mode!r}")
    spec = RegisterSpec(dispatch_mode, execute_mode, blocking, pad)
    if execute_mode is Execute.RANK_ZERO and dispatch_mode is not Dispatch.ONE_TO_ALL:
        raise ValueError("Execute.RANK_ZERO runs one rank, so it only combines with Dispatch.ONE_TO_ALL")
    if pad and not spec.splits_data:
        raise ValueError(f"pad=True needs a splitting dispatch mode (DP_COMPUTE or nd_compute), got {dispatch_mode}")

    def tag(fn: F) -> F:
        setattr(fn, SPEC_ATTR, spec)
        return fn

    return tag


def get_register_spec(fn: Any) -> RegisterSpec | None:
    return getattr(fn, SPEC_ATTR, None)
