"""Several role classes in one worker process: `create_colocated_worker_cls`.

Colocating roles (actor, reference, critic) means one process per device slot holding one object per role, so
they share the device and take turns with its memory, instead of one process per role per slot.
The generated class exposes every registered method `m` of role `r` as `r_m` (same register spec), and
`RayWorkerGroup.spawn` turns a group of such actors back into per-role views.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from mrl.controller.decorator import SPEC_ATTR, RegisterSpec
from mrl.controller.mesh import DeviceMesh
from mrl.controller.worker import RayClassWithInitArgs, Worker
from mrl.controller.worker_group import registered_methods


class ColocatedWorker(Worker):
    """Holds `self.roles[role]`, one instance per role class in `_mrl_roles` (set on generated subclasses)."""

    _mrl_roles: ClassVar[dict[str, type]] = {}

    def __init__(self, role_init_args: Mapping[str, tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
        # First, so that rank 0 picks MASTER_PORT once and every role's Worker.__init__ reads the same one.
        super().__init__()
        self.roles = {
            role: cls(*role_init_args[role][0], **role_init_args[role][1]) for role, cls in self._mrl_roles.items()
        }

    def _mrl_mesh_info(self, name: str, role: str | None = None) -> DeviceMesh | None:
        if role is None:
            return super()._mrl_mesh_info(name)
        return self.roles[role]._mrl_mesh_info(name)


def _delegate(role: str, name: str, fn: Callable[..., Any], spec: RegisterSpec) -> Callable[..., Any]:
    def method(self: ColocatedWorker, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.roles[role], name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = f"{role}_{name}"
    method.__doc__ = fn.__doc__
    setattr(method, SPEC_ATTR, spec)
    return method


def create_colocated_worker_cls(class_dict: Mapping[str, type | RayClassWithInitArgs]) -> RayClassWithInitArgs:
    """One worker class instantiating every role of class_dict ({role: Worker subclass or RayClassWithInitArgs})
    in one process. Ray actor options of the roles are ignored: the process is one actor."""
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    roles = {r: c if isinstance(c, RayClassWithInitArgs) else RayClassWithInitArgs(c) for r, c in class_dict.items()}
    attrs: dict[str, Any] = {"_mrl_roles": {r: rc.cls for r, rc in roles.items()}}
    for role, rc in roles.items():
        if not role.isidentifier() or role.startswith("_"):
            raise ValueError(f"role name {role!r} must be an identifier not starting with '_'")
        if not issubclass(rc.cls, Worker):
            raise TypeError(f"role {role!r}: {rc.cls.__name__} is not a Worker subclass")
        for name, (fn, spec) in registered_methods(rc.cls).items():
            key = f"{role}_{name}"
            if key in attrs:  # e.g. role "a" method "b_m" and role "a_b" method "m"
                raise ValueError(f"two roles produce the colocated method name {key!r}; rename a role")
            attrs[key] = _delegate(role, name, fn, spec)
    cls = type("Colocated_" + "_".join(roles), (ColocatedWorker,), attrs)
    return RayClassWithInitArgs(cls, {r: (rc.args, rc.kwargs) for r, rc in roles.items()})
