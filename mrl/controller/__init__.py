"""Single controller: the driver calls group methods; `@register` decides how each call is split over the
workers and how results are collected (see DESIGN.md, "Contracts between the parts")."""

from mrl.controller.colocated import ColocatedWorker, create_colocated_worker_cls
from mrl.controller.decorator import Dispatch, Execute, NDCompute, RegisterSpec, nd_compute, register
from mrl.controller.future import GroupFuture
from mrl.controller.mesh import DeviceMesh, DispatchLayout
from mrl.controller.ray_worker_group import RayClassWithInitArgs, RayWorkerGroup, WorkerGroupStartTimeout
from mrl.controller.resource_pool import RayResourcePool, ResourcePoolUnschedulable
from mrl.controller.worker import Worker
from mrl.controller.worker_group import WorkerGroup

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
