"""`WorkerGroup`: one handle over the workers of a role; `@register`ed worker methods become group methods.

A group method runs `dispatch.plan_call` (split), hands the per-rank calls to the transport (`_execute`), and
either waits and collects (blocking) or returns a `GroupFuture`. Transports (Ray: `RayWorkerGroup`) implement
`_execute` and `_resolve` only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from mrl.controller.decorator import Dispatch, Execute, NDCompute, RegisterSpec, get_register_spec
from mrl.controller.dispatch import CallPlan, plan_call
from mrl.controller.future import GroupFuture
from mrl.controller.mesh import DispatchLayout

_QUERY_ALL = RegisterSpec(Dispatch.ONE_TO_ALL, Execute.ALL, blocking=True, pad=False)


def registered_methods(cls: type) -> dict[str, tuple[Callable[..., Any], RegisterSpec]]:
    """Every `@register`ed method of cls (inherited ones included), by name."""
    found = {}
    for name in dir(cls):
        fn = getattr(cls, name, None)
        spec = get_register_spec(fn)
        if spec is not None:
            found[name] = (fn, spec)
    return found


class WorkerGroup:
    def __init__(self, world_size: int, role: str | None = None) -> None:
        self._world_size = world_size
        # A view over one role of a colocated worker: its methods and meshes are the role object's.
        self._role = role
        self._layouts: dict[str, DispatchLayout] = {}

    @property
    def world_size(self) -> int:
        return self._world_size

    # --- transport ---

    def _execute(self, method: str, plan: CallPlan) -> list[Any]:
        """Start method on each rank of plan.ranks (call i with plan.args[i], plan.kwargs[i], after plan.after
        are done, returning its result only if plan.keep[i]); return one handle per call."""
        raise NotImplementedError

    def _resolve(self, handles: list[Any], method: str = "", ranks: list[int] | None = None) -> list[Any]:
        """Wait for handles (the calls of `method` on `ranks`) and return their values, raising the first worker
        error, or an error naming the method and the silent ranks when the transport's time limit passes."""
        raise NotImplementedError

    # --- binding ---

    def _bind_worker_methods(self, cls: type, worker_prefix: str = "") -> None:
        """Create a group method for each registered method of cls. A group method `m` calls the worker method
        `worker_prefix + m` (the prefixed copy of a role's method on a colocated worker)."""
        for name, (fn, spec) in registered_methods(cls).items():
            if hasattr(self, name):
                raise AttributeError(f"worker method {cls.__name__}.{name} collides with a WorkerGroup attribute")
            setattr(self, name, self._group_method(worker_prefix + name, fn, spec))

    def _group_method(self, worker_method: str, fn: Callable[..., Any], spec: RegisterSpec) -> Callable[..., Any]:
        @functools.wraps(fn)
        def group_method(*args: Any, **kwargs: Any) -> Any:
            return self.call(worker_method, spec, *args, **kwargs)

        return group_method

    def call(self, worker_method: str, spec: RegisterSpec, *args: Any, **kwargs: Any) -> Any:
        """Split → execute on the workers → collect (or a GroupFuture when the spec is non-blocking)."""
        layout = self._layout(spec)
        plan = plan_call(worker_method, spec, self._world_size, args, kwargs, layout)
        handles = self._execute(worker_method, plan)
        future = GroupFuture(handles, plan.collect, lambda hs: self._resolve(hs, worker_method, plan.ranks))
        return future.get() if spec.blocking else future

    # --- meshes ---

    def _layout(self, spec: RegisterSpec) -> DispatchLayout | None:
        mode = spec.dispatch_mode
        if isinstance(mode, NDCompute):
            return self.dispatch_layout(mode.mesh_name)
        return DispatchLayout.data_parallel(self._world_size) if spec.splits_data else None

    def dispatch_layout(self, mesh_name: str) -> DispatchLayout:
        """The layout of the named mesh, asked from every worker on first use and cached: meshes are fixed once
        registered (a rank's place in TP/PP/DP does not change during a run)."""
        if mesh_name not in self._layouts:
            meshes = self.call("_mrl_mesh_info", _QUERY_ALL, mesh_name, self._role)
            self._layouts[mesh_name] = DispatchLayout.from_meshes(mesh_name, meshes)
        return self._layouts[mesh_name]
