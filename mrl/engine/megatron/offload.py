"""Offload of training state between phases: free the device memory of parameters, gradients and optimizer
state, and bring it back bit for bit.

Megatron's DDP keeps parameters (distributed optimizer) and gradients in contiguous buffers, and model params,
`main_grad`s, optimizer shards and bucket views are all *views* of those buffers' storages. So the unit of
offload is a storage, not a tensor: each distinct storage is copied to host memory (pinned on CUDA) and then
resized to 0 bytes, which frees it while every view keeps pointing at it; onload resizes it back and copies the
bytes in. Views never need re-pointing, and the same code runs on CPU (where the "device" is the host and
offload is a copy into separate storage followed by freeing the original).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor


def _byte_view(storage: torch.UntypedStorage) -> Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class StorageOffloader:
    """Holds host copies of a set of storages while they are offloaded."""

    def __init__(self) -> None:
        self._host: dict[int, tuple[torch.UntypedStorage, Tensor]] = {}

    @property
    def offloaded(self) -> bool:
        return bool(self._host)

    def offload(self, tensors: Iterable[Tensor]) -> int:
        """Copy each distinct storage behind `tensors` to host memory and free it; returns the bytes freed."""
        freed = 0
        pin = torch.cuda.is_available()
        for t in tensors:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self._host or storage.nbytes() == 0:
                continue
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(_byte_view(storage), non_blocking=pin)
            self._host[key] = (storage, host)
        if pin:
            torch.cuda.synchronize()
        for storage, _ in self._host.values():
            if storage.nbytes():
                freed += storage.nbytes()
                storage.resize_(0)
        return freed

    def onload(self) -> int:
        """Re-allocate every offloaded storage and copy its bytes back; returns the bytes restored."""
        restored = 0
        for storage, host in self._host.values():
            storage.resize_(host.numel())
            _byte_view(storage).copy_(host, non_blocking=True)
            restored += host.numel()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._host.clear()
        return restored


def param_tensors(ddp_chunks: Iterable[Any]) -> list[Tensor]:
    """Parameter storages: the DDP param buffers (distributed optimizer) or the parameters themselves."""
    out: list[Tensor] = []
    for chunk in ddp_chunks:
        for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
            if buffer.param_data is not None:
                out.append(buffer.param_data)
        out.extend(p.data for p in chunk.module.parameters())
    return out


def grad_tensors(ddp_chunks: Iterable[Any]) -> list[Tensor]:
    return [b.grad_data for c in ddp_chunks for b in [*c.buffers, *c.expert_parallel_buffers]]


def optimizer_tensors(optimizer: Any) -> list[Tensor]:
    """Optimizer state (Adam moments) and the fp32 master copies of low-precision parameters."""
    out: list[Tensor] = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for state in inner.state.values():
            out.extend(v for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        for groups_name in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            for group in getattr(opt, groups_name, None) or []:
                out.extend(group)
    return out
