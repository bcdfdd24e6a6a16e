"""Single controller: the driver calls group methods; `@register` decides how each call is split over the
workers and how results are collected (see DESIGN.md, "Contracts between the parts").

The worker-side API (Worker, register, meshes, colocated classes) does not import Ray, so worker code runs where
Ray is absent (the GPU machine drives workers with torchrun); the Ray parts load on first access.
"""

from importlib import import_module
from typing import Any

from mrl.controller.colocated import ColocatedWorker, create_colocated_worker_cls
from mrl.controller.decorator import Dispatch, Execute, NDCompute, RegisterSpec, nd_compute, register
from mrl.controller.future import GroupFuture
from mrl.controller.mesh import DeviceMesh, DispatchLayout
from mrl.controller.worker import RayClassWithInitArgs, Worker
from mrl.controller.worker_group import WorkerGroup

_RAY_PARTS = {
    "RayWorkerGroup": "mrl.controller.ray_worker_group",
    "WorkerGroupStartTimeout": "mrl.controller.ray_worker_group",
    "RayResourcePool": "mrl.controller.resource_pool",
    "ResourcePoolUnschedulable": "mrl.controller.resource_pool",
}


def __getattr__(name: str) -> Any:
    if name in _RAY_PARTS:
        return getattr(import_module(_RAY_PARTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ColocatedWorker",
    "DeviceMesh",
    "Dispatch",
    "DispatchLayout",
    "Execute",
    "GroupFuture",
    "NDCompute",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "RegisterSpec",
    "ResourcePoolUnschedulable",
    "Worker",
    "WorkerGroup",
    "WorkerGroupStartTimeout",
    "create_colocated_worker_cls",
    "nd_compute",
    "register",
]
