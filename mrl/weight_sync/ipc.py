"""`ipc`: same-device weight sync through two shared flat buffers (hybrid and colocated replicas).

On GPU the buffers are device memory shared by CUDA IPC handles; on CPU they are files in /dev/shm mapped by
both sides (`torch.from_file(shared=True)`). The sender fills bucket k+1 into one buffer while the receivers load
bucket k from the other, straight from the mapped memory (views, no staging copy); a buffer is refilled only after
every receiver has acknowledged the bucket it carried.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from mrl.weight_sync.base import WeightReceiver, WeightSender, sync_device
from mrl.weight_sync.buckets import BucketReader, fill_buckets

NUM_BUFFERS = 2


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class IpcSender(WeightSender):
    transport = "ipc"

    def __init__(self, *args: Any, device: str | torch.device | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.buffers: list[torch.Tensor] = []
        self._files: list[str] = []

    def _prepare(self) -> dict[str, Any]:
        if self.device.type == "cuda":
            from rollout_adapters.cuda_ipc import share_cuda_buffer

            self.buffers = [torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device)
                            for _ in range(NUM_BUFFERS)]
            uuid = str(torch.cuda.get_device_properties(self.device).uuid)
            return {"device": "cuda", "gpu": uuid, "handles": [share_cuda_buffer(b) for b in self.buffers]}
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

        def before_reuse(k: int) -> None:
            old = k - NUM_BUFFERS
            c.wait(f"bucket {old} acknowledged", {r: c.key("ack", old, r) for r in receivers})

        count = k = 0
        for k, slot, entries, _ in fill_buckets(named_tensors, self.buffers, before_reuse):
            sync_device()
            c.set({"slot": slot, "entries": entries}, "meta", k)
            count += sum(start + nbytes == total for *_, nbytes, start, total in entries)
            k += 1
        c.set({"end": True}, "meta", k)
        for old in range(max(k - NUM_BUFFERS, 0), k):
            c.wait(f"bucket {old} acknowledged", {r: c.key("ack", old, r) for r in receivers})
        return count

    def _finalize(self) -> None:
        self.buffers = []
        for path in self._files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # mappings stay valid until their tensors are freed
        self._files = []


class IpcReceiver(WeightReceiver):
    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        super().__init__(spec, rank)
        if spec["device"] == "cuda":
            from rollout_adapters.cuda_ipc import open_cuda_buffer

            here = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
            if here != spec["gpu"]:
                raise ValueError(
                    f"weight_sync.transport=ipc: rollout rank {rank} is on GPU {here}, the trainer's buffers on "
                    f"{spec['gpu']}; ipc shares memory on one device only (use nccl for other devices)"
                )
            self.buffers = [open_cuda_buffer(h) for h in spec["handles"]]
        else:
            size = spec["bucket_bytes"]
            self.buffers = [torch.from_file(p, shared=True, size=size, dtype=torch.uint8) for p in spec["files"]]

    def _receive(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        c, reader, k = self.control, BucketReader(), 0
        while True:
            meta = c.get(f"bucket {k} announced", "meta", k)
            if meta.get("end"):
                break
            yield reader.read(self.buffers[meta["slot"]], meta["entries"])
            sync_device()  # the loads issued by the caller have read the buffer
            c.set(1, "ack", k, self.rank)
            k += 1
        reader.check_complete()

    def finalize(self) -> None:
        self.buffers = []
        super().finalize()
