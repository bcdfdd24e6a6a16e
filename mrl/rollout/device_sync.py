"""Per-device weight sync (`ipc` into hybrid and colocated replicas): every trainer rank feeds the engine workers
that sit on its own device slot, so no rank's buffers have to be reachable from another device.

Placement is fixed by the pools: trainer rank r runs on slot r, and replica i's engine worker j on slot
i × footprint + j (mrl/rollout/replica.py). Each rank with workers on its slot hosts one `ipc` sender (a group of
itself and those workers); the specs are all-gathered over the trainer's process group and rank 0 starts every
replica's receive with one (spec, group rank) per engine worker.

When the engine's TP ranks pair with the trainer's on the same devices (engine TP = trainer TP, one replica
per TP group, no engine PP/DP), the dense TP-split tensors travel as each rank's own slice (bridges/export.py
`tp_slices`): each device moves about 1/TP of those bytes. Every other tensor, and every other layout, sends
whole tensors, which the engine's loaders cut themselves.

Failures: a rank whose sender or receiver fails stops sending but keeps walking the export (its collectives must
line up with the other ranks'), then every rank learns every failure and raises the same error, naming the ranks.
A replica whose load failed keeps its old version (the adapter stamps a version only after a whole load).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import ray
import torch.distributed as dist

from bridges.export import stream_tags
from mrl.rollout.client import wait_within
from mrl.rollout.replica import Footprint, server_rank
from mrl.weight_sync import make_sender
from mrl.weight_sync.base import TIMEOUT_KNOB


def workers_on_slots(server_ids: Iterable[str], devices: int) -> dict[int, list[tuple[str, int]]]:
    """slot → [(server id, engine worker index)] of the replicas of `devices` slots each (a hybrid slot holds one
    engine worker; a PD replica's workers count through its members in slot order)."""
    slots: dict[int, list[tuple[str, int]]] = {}
    for sid in server_ids:
        first = server_rank(sid) * devices
        for worker in range(devices):
            slots.setdefault(first + worker, []).append((sid, worker))
    return slots


def tp_slices_pair(footprint: Footprint, trainer_tp: int) -> bool:
    """Whether engine TP rank j sits on the device of trainer TP rank j for every replica (then a rank's TP slice
    is its engine worker's)."""
    return trainer_tp > 1 and footprint.tp == trainer_tp and footprint.pp == 1 and footprint.dp == 1


@dataclass
class SentBytes:
    """What one rank sent: tensors and bytes, as TP slices and as whole tensors; and where its host time went, so a
    slow sync shows which side it waited on (ipc, per device): setting the sync up (the pool's view, the senders'
    buffers and handles, starting the replicas' receive), sending (inside it: making the stream, i.e. the export and
    quantising with rollout.quantization=fp8, and waiting for the receivers to acknowledge buckets), and rank 0's
    wait for the replicas to finish loading after its last bucket."""

    tensors: int = 0
    sliced: int = 0
    whole: int = 0
    receivers: list[str] = field(default_factory=list)
    one_copy: bool = False  # sent as handles of the trainer's own memory (weight_sync.one_copy on CUDA)
    produce_s: float = 0.0  # host seconds inside the stream's own generators
    ack_wait_s: float = 0.0  # host seconds the sender waited for receivers (ipc)
    setup_s: float = 0.0
    send_s: float = 0.0  # produce_s and ack_wait_s are part of it
    replica_wait_s: float = 0.0

    def count(self, stream: Iterable[tuple]) -> Iterator[tuple]:
        items = iter(stream)
        while True:
            start = time.perf_counter()
            item = next(items, None)
            self.produce_s += time.perf_counter() - start
            if item is None:
                return
            nbytes = item[1].numel() * item[1].element_size()
            if stream_tags(item[2:])[0] is not None:
                self.sliced += nbytes
            else:
                self.whole += nbytes
            self.tensors += 1
            yield item

    def metrics(self) -> dict[str, Any]:
        return {"tensors": self.tensors, "bytes_sliced": self.sliced, "bytes_whole": self.whole,
                "bytes_one_copy": (self.sliced + self.whole) if self.one_copy else 0, "receivers": self.receivers,
                "produce_s": self.produce_s, "ack_wait_s": self.ack_wait_s, "setup_s": self.setup_s,
                "send_s": self.send_s, "replica_wait_s": self.replica_wait_s}


def _drain(stream: Iterator[tuple]) -> None:
    for _ in stream:  # the export's collectives run on every rank, whether or not it sends
        pass


def sync_per_device(manager: Any, stream: Iterable[tuple], version: int, bucket_bytes: int, timeout_s: float,
                    **sender_kwargs: Any) -> dict[str, Any]:
    """Run on every trainer rank (collective over the default process group): send `stream` to the engine
    workers on this rank's slot, stamped `version`. Returns this rank's `SentBytes.metrics()` (rank 0 adds
    "replica_tensors": tensors loaded per replica)."""
    rank, world, started = dist.get_rank(), dist.get_world_size(), time.perf_counter()
    registered = [manager.servers_for_transport_sync(version) if rank == 0 else None]
    dist.broadcast_object_list(registered, src=0)  # every rank acts on rank 0's one view of the pool
    handles: dict[str, Any] = registered[0]  # type: ignore[assignment]
    routes = workers_on_slots(handles, manager.replica_devices)
    if any(slot >= world for slot in routes):  # every rank sees the same routes: all raise, none waits
        raise ValueError(f"weight_sync.transport=ipc: replicas on slots {sorted(routes)} but trainer ranks on slots "
                         f"0..{world - 1} only; every engine worker needs a trainer rank on its device")
    mine = routes.get(rank, [])
    sent, stream, error = SentBytes(receivers=[f"{sid}/{w}" for sid, w in mine]), iter(stream), None
    sender = make_sender("ipc", 1 + len(mine), bucket_bytes, timeout_s, **sender_kwargs) if mine else None
    sent.one_copy = bool(getattr(sender, "one_copy", False))
    specs: list[Any] = [None] * world
    dist.all_gather_object(specs, sender.prepare() if sender is not None else None)
    refs = {}
    if rank == 0:
        footprint = manager.replica_devices
        for sid, handle in handles.items():
            first = server_rank(sid) * footprint
            per_worker = [(specs[first + w], 1 + routes[first + w].index((sid, w))) for w in range(footprint)]
            refs[sid] = handle.receive_weights.remote(per_worker, 0, version)
    try:
        if sender is not None:
            sender.init_process_group()
            sent.setup_s, sending = time.perf_counter() - started, time.perf_counter()
            sender.send_weights(sent.count(stream))
            sent.ack_wait_s = sender.ack_wait_s
            sender.finalize()
            sent.send_s = time.perf_counter() - sending
    except BaseException as failure:  # every rank must reach the verdict below
        error = f"{type(failure).__name__}: {failure}"
        sender.finalize(wait=False)  # type: ignore[union-attr]
    _drain(stream)
    counts: list[int] = []
    if rank == 0 and refs:
        waiting = time.perf_counter()
        try:
            wait_within(refs, timeout_s, "weight sync (ipc, per device) receive and load on replicas", TIMEOUT_KNOB)
            counts = ray.get(list(refs.values()))
        except Exception as failure:
            error = error or f"{type(failure).__name__}: {failure}"
        sent.replica_wait_s = time.perf_counter() - waiting
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error)
    failed = {r: e for r, e in enumerate(errors) if e is not None}
    if failed:
        lines = "; ".join(f"trainer rank {r}: {e.splitlines()[0] if e else ''}" for r, e in failed.items())
        raise RuntimeError(f"weight sync (ipc, per device) to version {version} failed on {len(failed)} rank(s) "
                           f"({lines}); replicas whose load failed keep their previous version")
    return {**sent.metrics(), **({"replica_tensors": counts} if rank == 0 else {})}
