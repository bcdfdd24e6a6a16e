"""`RayWorkerGroup`: a `WorkerGroup` whose workers are Ray actors, one per device slot of a `RayResourcePool`."""

from __future__ import annotations

import os
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from typing import Any

import ray

from mrl.controller.dispatch import CallPlan
from mrl.controller.future import Gather
from mrl.controller.resource_pool import RayResourcePool, node_ip, placement_options
from mrl.controller.worker import DEFAULT_MASTER_ADDR, RayClassWithInitArgs
from mrl.controller.worker_group import WorkerGroup


def _exporting_env(cls: type) -> type:
    """cls whose constructor first exports the rank and rendezvous variables the group assigns (Worker.__init__
    reads them). Passing them to the constructor rather than as a per-actor runtime_env lets Ray place the actors
    in its already started idle worker processes; the cost is that they are not yet set while the worker's
    modules are imported."""

    def __init__(self: Any, *args: Any, _mrl_env: dict[str, str], **kwargs: Any) -> None:
        os.environ.update(_mrl_env)
        cls.__init__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__qualname__": cls.__qualname__})


class WorkerGroupStartTimeout(RuntimeError):
    pass


class DispatchTimeoutError(TimeoutError):
    pass


# A hung collective or a dead peer must end in an error that says where, not in a driver waiting forever.
DEFAULT_CALL_TIMEOUT_S = 3600.0


def _shareable(value: Any) -> bool:
    """Worth one ray.put when several ranks receive the same object (a chunk seen by all TP ranks of a DP
    group, a ONE_TO_ALL batch): small scalars and refs are not."""
    return not isinstance(value, str | int | float | bool | bytes | type(None) | ray.ObjectRef | Gather)


class RayWorkerGroup(WorkerGroup):
    def __init__(
        self,
        resource_pool: RayResourcePool,
        ray_cls_with_init: RayClassWithInitArgs,
        name_prefix: str | None = None,
        master_addr: str | None = DEFAULT_MASTER_ADDR,
        start_timeout_s: float | None = None,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> None:
        """Create one actor per slot of resource_pool, named `{name_prefix}_{rank}`.

        Rank 0 starts first and chooses MASTER_PORT on master_addr; the other ranks start with that address and
        port in their environment. master_addr=None uses the IP of rank 0's node (needed across nodes).
        Workers that cannot start within start_timeout_s (default: the pool's timeout) — typically because more
        than max_colocate_count groups were put on the pool — are killed and WorkerGroupStartTimeout is raised;
        an exception in a worker's constructor is raised here too. A group call whose workers do not all answer
        within call_timeout_s (trainer.dispatch_timeout_s) raises DispatchTimeoutError naming the silent ranks.
        """
        super().__init__(resource_pool.world_size)
        self.call_timeout_s = call_timeout_s
        self.name_prefix = name_prefix or f"{ray_cls_with_init.cls.__name__}_{uuid.uuid4().hex[:8]}"
        self._worker_cls = ray_cls_with_init.cls
        timeout = resource_pool.timeout_s if start_timeout_s is None else start_timeout_s
        self._workers = self._create_workers(resource_pool, ray_cls_with_init, master_addr, timeout)
        self._bind_worker_methods(self._worker_cls)

    def _create_workers(
        self, pool: RayResourcePool, rc: RayClassWithInitArgs, master_addr: str | None, timeout: float
    ) -> list[Any]:
        remote_cls = ray.remote(_exporting_env(rc.cls))
        slots = pool.slots()
        rendezvous = {"MASTER_ADDR": master_addr or node_ip(*slots[0])}
        workers: list[Any] = []
        deadline = time.monotonic() + timeout
        try:
            for rank, (pg, bundle) in enumerate(slots):
                env = {"RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(bundle), **rendezvous}
                options = {**placement_options(pool, pg, bundle), "name": f"{self.name_prefix}_{rank}", **rc.options}
                workers.append(remote_cls.options(**options).remote(*rc.args, _mrl_env=env, **rc.kwargs))
                if rank == 0:
                    addr, port = ray.get(workers[0]._mrl_master_addr_port.remote(), timeout=timeout)
                    rendezvous = {"MASTER_ADDR": addr, "MASTER_PORT": str(port)}
            started = [w.__ray_ready__.remote() for w in workers]
            remaining = max(deadline - time.monotonic(), 0.0)
            _, pending = ray.wait(started, num_returns=len(started), timeout=remaining)
            if pending:
                raise ray.exceptions.GetTimeoutError(f"{len(pending)} of {len(workers)} workers pending")
            ray.get(started)
        except Exception as err:
            for w in workers:  # a half-started group would hold its slots and never serve
                ray.kill(w)
            if not isinstance(err, ray.exceptions.GetTimeoutError):
                raise
            share = {k: round(v, 4) for k, v in pool.worker_resources().items()}
            raise WorkerGroupStartTimeout(
                f"workers of group {self.name_prefix!r} did not start within {timeout:g} s ({err}): each asks "
                f"{share} of a slot {pool.bundle} in pool {pool.name_prefix!r}, which admits "
                f"max_colocate_count={pool.max_colocate_count} workers per slot"
            ) from None
        return workers

    @classmethod
    def _role_view(cls, parent: RayWorkerGroup, role: str, role_cls: type) -> RayWorkerGroup:
        view = cls.__new__(cls)
        WorkerGroup.__init__(view, parent.world_size, role=role)
        view.name_prefix = parent.name_prefix
        view.call_timeout_s = parent.call_timeout_s
        view._worker_cls = role_cls
        view._workers = parent._workers
        view._bind_worker_methods(role_cls, worker_prefix=f"{role}_")
        return view

    @property
    def workers(self) -> list[Any]:
        return list(self._workers)

    @property
    def worker_names(self) -> list[str]:
        return [f"{self.name_prefix}_{rank}" for rank in range(self.world_size)]

    def spawn(self, prefix_set: Iterable[str]) -> dict[str, RayWorkerGroup]:
        """Per-role views over the actors of a colocated worker (create_colocated_worker_cls): view.m(...)
        calls the worker method `{role}_m`, nd_compute uses the role's meshes; the actors are the same."""
        roles = getattr(self._worker_cls, "_mrl_roles", None)
        if roles is None:
            raise TypeError(f"{self._worker_cls.__name__} is not a colocated worker class; nothing to spawn")
        unknown = sorted(set(prefix_set) - set(roles))
        if unknown:
            raise KeyError(f"no role(s) {unknown} in this colocated group; roles: {sorted(roles)}")
        return {role: self._role_view(self, role, roles[role]) for role in prefix_set}

    def _execute(self, method: str, plan: CallPlan) -> list[Any]:
        # Objects sent to several ranks go to the object store once instead of once per task.
        counts = Counter(id(v) for a, k in zip(plan.args, plan.kwargs) for v in (*a, *k.values()) if _shareable(v))
        refs: dict[int, Any] = {}

        def ship(v: Any) -> Any:
            if counts.get(id(v), 0) < 2 or not _shareable(v):
                return v
            if id(v) not in refs:
                refs[id(v)] = ray.put(v)
            return refs[id(v)]

        # plan.after go first as top-level arguments: Ray runs the task only once they are done (and fails it with
        # their error); Worker._mrl_execute drops them before calling the method.
        return [
            self._workers[r]._mrl_execute.remote(
                method, keep, len(plan.after), *plan.after, *map(ship, a), **{n: ship(v) for n, v in k.items()}
            )
            for r, a, k, keep in zip(plan.ranks, plan.args, plan.kwargs, plan.keep)
        ]

    def _resolve(self, handles: list[Any], method: str = "", ranks: list[int] | None = None) -> list[Any]:
        ranks = list(range(len(handles))) if ranks is None else ranks
        deadline = time.monotonic() + self.call_timeout_s
        pending = list(handles)
        while pending:
            # One at a time, so that a worker's error surfaces at once instead of after the ranks blocked on it
            # (in a collective with the failed rank) reach the time limit.
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                silent = [r for r, h in zip(ranks, handles) if h in pending]
                raise DispatchTimeoutError(
                    f"{self.name_prefix}.{method}: rank(s) {silent} of {self.world_size} did not answer within "
                    f"{self.call_timeout_s:g} s (trainer.dispatch_timeout_s); the other called rank(s) "
                    f"{[r for r in ranks if r not in silent]} did"
                )
            ray.get(ready)
        return ray.get(handles)

    def kill(self) -> None:
        """Stop the actors (views share them: kill through one handle only)."""
        for w in self._workers:
            ray.kill(w)
