"""Weight-sync transports (DESIGN.md glossary): `ipc` (same device), `nccl` (its own process group, kept across
syncs; gloo on CPU) and `disk` (safetensors by path), behind one interface (mrl/weight_sync/base.py). The sync state
machine of the async trainer modes lives in state_machine.py.

This package imports torch and safetensors only: vLLM's worker processes and the GPU benchmark import it too.
"""

from __future__ import annotations

import contextlib
from typing import Any

from mrl.weight_sync.base import WeightReceiver, WeightSender, WeightSyncPeerError, WeightSyncTimeout

TRANSPORTS = ("ipc", "nccl", "disk")

__all__ = ["TRANSPORTS", "WeightReceiver", "WeightSender", "WeightSyncPeerError", "WeightSyncTimeout",
           "make_receiver", "make_sender", "receive_into", "report_failure"]


def _classes(transport: str) -> tuple[type[WeightSender], type[WeightReceiver]]:
    if transport == "ipc":
        from mrl.weight_sync.ipc import IpcReceiver, IpcSender

        return IpcSender, IpcReceiver
    if transport == "nccl":
        from mrl.weight_sync.nccl import NcclReceiver, NcclSender

        return NcclSender, NcclReceiver
    if transport == "disk":
        from mrl.weight_sync.disk import DiskReceiver, DiskSender

        return DiskSender, DiskReceiver
    raise ValueError(f"weight_sync.transport={transport!r} is not a transport; known: {list(TRANSPORTS)}")


def make_sender(transport: str, world_size: int, bucket_bytes: int, timeout_s: float, **kwargs: Any) -> WeightSender:
    """The trainer side: rank 0 of a group of `world_size` (itself plus every rollout worker)."""
    return _classes(transport)[0](world_size, bucket_bytes, timeout_s, **kwargs)


def make_receiver(spec: dict[str, Any], rank: int, keep_parts: bool = False) -> WeightReceiver:
    """A rollout worker's side, from the spec its sender's `prepare()` returned. `keep_parts` (ipc with one_copy):
    TP slices and row blocks arrive tagged, for a loader that places them itself (handles.HandleReader)."""
    receiver_cls = _classes(spec["transport"])[1]
    if keep_parts and spec.get("one_copy"):
        return receiver_cls(spec, rank, keep_parts=True)  # type: ignore[call-arg]
    return receiver_cls.for_sync(spec, rank)


def receive_into(spec: dict[str, Any], rank: int, load: Any, keep_parts: bool = False) -> int:
    """Run one receiver to the end, calling `load(named_tensors)` per bucket; returns the tensors loaded.

    A failure here (the transport's or `load`'s) is reported to the sender, which stops at once with it.
    """
    receiver = make_receiver(spec, rank, keep_parts)
    count = 0
    try:
        receiver.init_process_group()
        for named in receiver.receive_weights():
            load(named)
            count += len(named)
            del named  # views of the sender's memory: let go before the bucket is acknowledged
    except BaseException as error:
        receiver.control.fail(error)
        receiver.close()
        raise
    receiver.finalize()
    return count


def report_failure(spec: dict[str, Any], rank: int, error: BaseException) -> None:
    """Tell the sender of `spec` that rank `rank` failed (e.g. before its receiver could start)."""
    from mrl.weight_sync.base import Control

    with contextlib.suppress(Exception):  # the sender is gone: nobody to tell
        Control(spec, rank, connect_s=10).fail(error)
