"""`ipc`: same-device weight sync through two shared flat buffers (hybrid and colocated replicas).

On GPU the buffers are device memory shared by CUDA IPC handles; on CPU they are files in /dev/shm mapped by
both sides (`torch.from_file(shared=True)`). The sender fills bucket k+1 into one buffer while the receivers load
bucket k from the other, straight from the mapped memory (views, no staging copy); a buffer is refilled only after
every receiver has acknowledged the bucket it carried.

On GPU the hand-overs are ordered on the device, not by host syncs: the sender records a shared (interprocess)
event after a bucket's copies and announces the bucket at once; a receiver's stream waits on that event before
its loads and records its own "loaded" event before it acknowledges; the sender's stream waits on those before it
refills the buffer. So neither host blocks on the GPU inside the sync, and the sender's Python work of bucket k+1
(export, packing calls) overlaps the copies of bucket k. A receiver's loader must issue its copies on the current
stream (vLLM's weight loaders do); the receiver synchronises once, before it reports done.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from mrl.weight_sync.base import WeightReceiver, WeightSender, sync_device
from mrl.weight_sync.buckets import BucketReader, completed, fill_buckets
from mrl.weight_sync.handles import HandleReader, share_buckets

NUM_BUFFERS = 2


def shared_event() -> Any:
    return torch.cuda.Event(enable_timing=False, interprocess=True)


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class IpcSender(WeightSender):
    transport = "ipc"

    def __init__(self, *args: Any, device: str | torch.device | None = None, one_copy: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.one_copy = one_copy and self.device.type == "cuda"
        self.shared: dict[str, float] = {}  # one_copy: buckets, storage handles, staged bytes of the last sync
        self.ack_wait_s = 0.0  # host seconds the last send waited for the receivers' acknowledgements
        self.buffers: list[torch.Tensor] = []
        self.ring: list[torch.Tensor] = []  # one_copy: the staging ring (handles.share_buckets), kept to the end
        self._files: list[str] = []
        self.filled: list[Any] = []  # CUDA only: per buffer, recorded by the sender after a bucket's copies
        self.loaded: list[list[Any]] = []  # CUDA only: per buffer and receiver, recorded after its loads

    def _prepare(self) -> dict[str, Any]:
        if self.device.type == "cuda":
            from mrl.weight_sync.cuda_ipc import share_cuda_buffer

            self.buffers = [] if self.one_copy else [
                torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device) for _ in range(NUM_BUFFERS)]
            uuid = str(torch.cuda.get_device_properties(self.device).uuid)
            with torch.cuda.device(self.device):  # an event's handle is created on the current device
                self.filled = [shared_event() for _ in range(NUM_BUFFERS)]
                self.loaded = [[shared_event() for _ in range(1, self.world_size)] for _ in range(NUM_BUFFERS)]
                events = {"filled_events": [e.ipc_handle() for e in self.filled],
                          "loaded_events": [[e.ipc_handle() for e in per_slot] for per_slot in self.loaded]}
            return {"device": "cuda", "gpu": uuid, "handles": [share_cuda_buffer(b) for b in self.buffers],
                    "one_copy": self.one_copy, **events}
        for i in range(NUM_BUFFERS):
            path = os.path.join(_shm_dir(), f"{self.control.prefix}_{i}")
            with open(path, "wb") as f:
                f.truncate(self.bucket_bytes)
            self._files.append(path)
            self.buffers.append(torch.from_file(path, shared=True, size=self.bucket_bytes, dtype=torch.uint8))
        return {"device": "cpu", "files": list(self._files)}

    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        c = self.control
        receivers = range(1, self.world_size)

        waited = [0.0]  # host seconds waiting for acknowledgements (the receivers are behind)
        # one_copy: when the send began and each bucket was announced (perf_counter, comparable with the
        # receivers' HandleReader.stats on the same host): where a sync's time goes, for benchmarks
        started, announced = time.perf_counter(), []

        def before_reuse(k: int) -> None:
            old, start = k - NUM_BUFFERS, time.perf_counter()
            c.wait(f"bucket {old} acknowledged", {r: c.key("ack", old, r) for r in receivers})
            waited[0] += time.perf_counter() - start
            for event in self.loaded[k % NUM_BUFFERS] if self.loaded else ():
                torch.cuda.current_stream(self.device).wait_event(event)

        if self.one_copy:
            held: list[list] = [[] for _ in range(NUM_BUFFERS)]
            buckets = ((k, k % NUM_BUFFERS, meta) for k, meta in share_buckets(
                named_tensors, self.bucket_bytes, before_reuse, held, self.shared, ring=self.ring))
        else:
            buckets = ((k, slot, {"entries": entries}) for k, slot, entries, _ in fill_buckets(
                named_tensors, self.buffers, before_reuse))
        count = k = 0
        for k, slot, meta in buckets:
            if self.filled:
                self.filled[slot].record(torch.cuda.current_stream(self.device))
            else:
                sync_device()  # e.g. device tensors copied into host shared memory
            c.set({"slot": slot, **meta}, "meta", k)
            announced.append(time.perf_counter())
            count += len(meta["entries"]) if self.one_copy else completed(meta["entries"])
            k += 1
        c.set({"end": True}, "meta", k)
        for old in range(max(k - NUM_BUFFERS, 0), k):
            c.wait(f"bucket {old} acknowledged", {r: c.key("ack", old, r) for r in receivers})
            for event in self.loaded[old % NUM_BUFFERS] if self.one_copy else ():
                torch.cuda.current_stream(self.device).wait_event(event)  # before the bucket's tensors are freed
        self.ack_wait_s = waited[0]
        if self.one_copy:
            self.shared.update(ack_wait_s=waited[0], send_start=started, announced_at=announced)
        return count

    def _finalize(self) -> None:
        self.buffers, self.filled, self.loaded, self.ring = [], [], [], []
        if self.one_copy:
            torch.cuda.ipc_collect()  # free the shared tensors the receivers have let go of
        for path in self._files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # mappings stay valid until their tensors are freed
        self._files = []


class IpcReceiver(WeightReceiver):
    def __init__(self, spec: dict[str, Any], rank: int, keep_parts: bool = False) -> None:
        super().__init__(spec, rank)
        # one_copy: views of the sender's own storages; TP slices and row blocks tagged if the caller places
        # them itself (keep_parts)
        self.handles = HandleReader(keep_parts) if spec.get("one_copy") else None
        if spec["device"] == "cuda":
            from mrl.weight_sync.cuda_ipc import open_cuda_buffer

            here = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
            if here != spec["gpu"]:
                raise ValueError(
                    f"weight_sync.transport=ipc: rollout rank {rank} is on GPU {here}, the trainer's buffers on "
                    f"{spec['gpu']}; ipc shares memory on one device only (use nccl for other devices)"
                )
            self.buffers = [open_cuda_buffer(h) for h in spec["handles"]]
            device = torch.cuda.current_device()
            self.filled = [torch.cuda.Event.from_ipc_handle(device, h) for h in spec["filled_events"]]
            self.loaded = [torch.cuda.Event.from_ipc_handle(device, per_slot[rank - 1])
                           for per_slot in spec["loaded_events"]]
        else:
            self.filled = self.loaded = []
            size = spec["bucket_bytes"]
            self.buffers = [torch.from_file(p, shared=True, size=size, dtype=torch.uint8) for p in spec["files"]]

    def _receive(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        c, reader, k = self.control, BucketReader(), 0
        while True:
            start = time.perf_counter()
            meta = c.get(f"bucket {k} announced", "meta", k)
            if self.handles is not None:
                self.handles.stats["wait_s"] += time.perf_counter() - start
            if meta.get("end"):
                break
            slot = meta["slot"]
            if self.filled:
                torch.cuda.current_stream().wait_event(self.filled[slot])
            if self.handles is not None:
                yield self.handles.read(meta)
                self.handles.done()
            else:
                yield reader.read(self.buffers[slot], meta["entries"])
            if self.loaded:
                self.loaded[slot].record()  # the sender's stream waits on it before refilling this buffer
            else:
                sync_device()  # the loads issued by the caller have read the buffer
            c.set(1, "ack", k, self.rank)
            k += 1
        reader.check_complete()
        if self.handles is not None:
            self.handles.release()

    def finalize(self) -> None:
        sync_device()  # every load has read the buffers before the sender may free them
        self.buffers, self.filled, self.loaded = [], [], []
        super().finalize()
