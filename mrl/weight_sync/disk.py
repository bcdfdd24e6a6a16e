"""`disk`: safetensors shards written by the sender and loaded by path (the universal fallback: any backend, any
placement that shares a filesystem). Each shard holds whole tensors, at most one bucket unless a tensor is larger;
a shard is announced as soon as it is written, so receivers load shard k while the sender writes shard k+1. The
folder is removed in `finalize`, after every receiver is done.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mrl.utils.buckets import group_by_bytes
from mrl.weight_sync.base import WeightReceiver, WeightSender


class DiskSender(WeightSender):
    transport = "disk"

    def __init__(self, *args: Any, directory: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parent = directory
        self.folder: str | None = None

    def _prepare(self) -> dict[str, Any]:
        if self.parent:
            os.makedirs(self.parent, exist_ok=True)
        self.folder = tempfile.mkdtemp(prefix=f"{self.control.prefix}_", dir=self.parent or None)
        return {"folder": self.folder}

    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        count = k = 0
        seen: set[str] = set()
        for group in group_by_bytes(named_tensors, self.bucket_bytes):
            shard = {}
            for name, tensor in group:
                if name in seen:
                    raise ValueError(f"weight stream repeats tensor {name!r}")
                seen.add(name)
                shard[name] = tensor.detach().to("cpu").contiguous()
            path = os.path.join(self.folder, f"shard-{k:05d}.safetensors")
            save_file(shard, path + ".tmp")
            os.replace(path + ".tmp", path)  # a reader never sees a partial shard
            self.control.set({"path": path, "names": list(shard)}, "meta", k)
            count += len(shard)
            k += 1
        self.control.set({"end": True}, "meta", k)
        return count

    def _finalize(self) -> None:
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


class DiskReceiver(WeightReceiver):
    def _receive(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        k = 0
        while True:
            meta = self.control.get(f"shard {k} announced", "meta", k)
            if meta.get("end"):
                return
            tensors = load_file(meta["path"])
            yield [(name, tensors[name]) for name in meta["names"]]  # the file's order is sorted, not the stream's
            k += 1
