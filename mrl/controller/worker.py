"""`Worker`: the base class of every process a `WorkerGroup` drives (one per device slot).

Rank, world size and the torch.distributed rendezvous come from the environment the group sets
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Rank 0 is created first; if no MASTER_PORT was given
it starts the rendezvous store's server on a port the OS picks on MASTER_ADDR (127.0.0.1 unless the group says
otherwise), writes the port back into its own environment, and the group passes the pair to every other rank.
Every rank joins with the default env:// method: rank 0's env:// store is multi-tenant, so it reuses the server
this process already runs on that port, and no other process can take the port between its choice and
`init_process_group()`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from mrl.controller.future import Gather
from mrl.controller.mesh import DeviceMesh

DEFAULT_MASTER_ADDR = "127.0.0.1"


_held_store: Any = None  # rank 0's TCPStore server, bound since the port was chosen


def serve_rendezvous(addr: str, world_size: int) -> int:
    """Start this process's torch.distributed store server on a port the OS picks on addr; return the port.

    Bound at once: in CI a port merely reported free was taken by another process on the host before rank 0
    reached `init_process_group()`, which then failed with EADDRINUSE.
    """
    global _held_store
    import torch.distributed as dist

    _held_store = dist.TCPStore(addr, 0, world_size, is_master=True, wait_for_workers=False, multi_tenant=True)
    return int(_held_store.port)


class Worker:
    """Subclasses call `super().__init__()` first, then build their state; methods tagged with `@register`
    become group methods of the `WorkerGroup` that drives them."""

    def __init__(self) -> None:
        env = os.environ
        self._rank = int(env.get("RANK", "0"))
        self._world_size = int(env.get("WORLD_SIZE", "1"))
        self._local_rank = int(env.get("LOCAL_RANK", "0"))
        env.setdefault("RANK", str(self._rank))
        env.setdefault("WORLD_SIZE", str(self._world_size))
        env.setdefault("LOCAL_RANK", str(self._local_rank))
        if not env.get("MASTER_ADDR"):
            if self._rank != 0:
                raise RuntimeError(f"rank {self._rank}: MASTER_ADDR is not set; only rank 0 may choose it")
            env["MASTER_ADDR"] = DEFAULT_MASTER_ADDR
        if not env.get("MASTER_PORT"):
            if self._rank != 0:
                raise RuntimeError(f"rank {self._rank}: MASTER_PORT is not set; only rank 0 may choose it")
            env["MASTER_PORT"] = str(serve_rendezvous(env["MASTER_ADDR"], self._world_size))
        self._master_addr = env["MASTER_ADDR"]
        self._master_port = int(env["MASTER_PORT"])
        self._meshes: dict[str, DeviceMesh] = {}

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def master_addr_port(self) -> tuple[str, int]:
        return self._master_addr, self._master_port

    def register_mesh(
        self, name: str, dims: Mapping[str, int] | DeviceMesh, coords: Mapping[str, int] | None = None
    ) -> DeviceMesh:
        """Declare this rank's place in the named device mesh (dims ordered slowest → fastest, see mesh.py), or
        register a ready DeviceMesh (e.g. an engine's `mesh()`).

        Without coords they follow from the rank. The mesh must cover the whole group: prod(dims) == world size.
        """
        mesh = dims if isinstance(dims, DeviceMesh) else DeviceMesh.create(dims, coords, rank=self._rank)
        if mesh.size != self._world_size:
            raise ValueError(f"mesh {name!r} {mesh.sizes} has {mesh.size} ranks, the group has {self._world_size}")
        self._meshes[name] = mesh
        return mesh

    def mesh(self, name: str) -> DeviceMesh:
        if name not in self._meshes:
            raise KeyError(f"no mesh {name!r} registered on rank {self._rank}; have {sorted(self._meshes)}")
        return self._meshes[name]

    # Entry points for the group; underscored so they never collide with role methods.

    def _mrl_master_addr_port(self) -> tuple[str, int]:
        return self.master_addr_port

    def _mrl_mesh_info(self, name: str, role: str | None = None) -> DeviceMesh | None:
        if role is not None:
            raise ValueError(f"{type(self).__name__} holds no roles (asked for {role!r})")
        return self._meshes.get(name)

    def _mrl_execute(
        self, _mrl_method_name: str, _mrl_keep_result: bool, _mrl_n_after: int, *args: Any, **kwargs: Any
    ) -> Any:
        """Run one rank's share of a group call: skip the first _mrl_n_after arguments (results of earlier calls
        this one had to wait for, see dispatch.CallPlan.after), resolve `Gather` arguments, call the method, and
        drop the result when this rank is not collected (so duplicates from TP/PP ranks never travel back)."""
        args = tuple(a.resolve() if isinstance(a, Gather) else a for a in args[_mrl_n_after:])
        kwargs = {k: v.resolve() if isinstance(v, Gather) else v for k, v in kwargs.items()}
        result = getattr(self, _mrl_method_name)(*args, **kwargs)
        return result if _mrl_keep_result else None


class RayClassWithInitArgs:
    """A worker class with its constructor arguments and extra Ray actor options (e.g. runtime_env).

    Plain data (no Ray import), so worker code can build one on machines without Ray."""

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        self.cls = cls
        self.args = args
        self.kwargs = kwargs
        self.options: dict[str, Any] = {}

    def update_options(self, **options: Any) -> RayClassWithInitArgs:
        self.options.update(options)
        return self
