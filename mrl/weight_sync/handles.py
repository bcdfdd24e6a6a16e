"""`ipc` with `one_copy` on CUDA: the buckets are the trainer's own memory, not flat buffers.

Instead of copying the stream into a shared buffer (which the engine then copies into its parameters: two device
copies), the sender shares the CUDA IPC handle of each tensor's storage (once per bucket) and describes the
tensor as a strided view of it; the engine maps the storages and copies every tensor straight from the trainer's
memory into its parameters: one device copy. Handles go this way round because vLLM's sleep-mode allocator maps
the engine's weights through cuMemCreate without a shareable handle type, which CUDA IPC cannot export.

A bucket holds at most `bucket_bytes` of tensors (a larger tensor is a bucket alone); the sender keeps the bucket's
tensors alive until every receiver acknowledged it (tensors the export created, e.g. split fused QKV, are freed
then), so at most two buckets of fresh tensors are held. Entries are `[name, dtype, shape, stride, offset,
storage]` (+ `[dim, rank, size]` for a TP slice, as in buckets.py): `offset` in elements of `dtype` from the start of
storage number `storage` of the bucket's `storages` (base64 of `rollout_adapters.cuda_ipc.share_cuda_buffer`).
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from mrl.weight_sync.buckets import in_full_shape


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)


def share_buckets(
    named_tensors: Iterable[tuple], bucket_bytes: int, before_reuse: Callable[[int], None], held: list[list],
    counts: dict[str, int] | None = None,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Group the stream into buckets of ≤ `bucket_bytes`; yield (bucket index, meta: entries + storages).
    `held[k % len(held)]` keeps bucket k's tensors alive; it is cleared after `before_reuse(k)` (the transport's
    wait for the receivers of bucket k - len(held)). `counts` gets the buckets and storage handles shared."""
    counts = {} if counts is None else counts
    counts.update(buckets=0, handles=0)
    from rollout_adapters.cuda_ipc import share_cuda_buffer

    k, used, entries, storages, index = 0, 0, [], [], {}
    seen: set[str] = set()

    def flush() -> Iterator[tuple[int, dict[str, Any]]]:
        nonlocal k, used, entries, storages, index
        yield k, {"entries": entries, "storages": storages}
        counts["buckets"] += 1
        counts["handles"] += len(storages)
        k, used, entries, storages, index = k + 1, 0, [], [], {}
        if k >= len(held):
            before_reuse(k)
        held[k % len(held)] = []  # the receivers are done with the bucket this slot carried

    for name, tensor, *tp_slice in named_tensors:
        if name in seen:
            raise ValueError(f"weight stream repeats tensor {name!r}")
        seen.add(name)
        t = tensor.detach()
        if t.device.type != "cuda":
            raise ValueError(f"weight_sync.one_copy: tensor {name!r} is on {t.device}, not on the CUDA device")
        nbytes = t.numel() * t.element_size()
        if entries and used + nbytes > bucket_bytes:
            yield from flush()
        key = t.untyped_storage().data_ptr()
        if key not in index:
            index[key] = len(storages)
            storages.append(base64.b64encode(share_cuda_buffer(_storage_bytes(t))).decode())
        held[k % len(held)].append(t)
        tail = [[tp_slice[0].dim, tp_slice[0].rank, tp_slice[0].size]] if tp_slice else []
        entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), list(t.stride()),
                        t.storage_offset(), index[key], *tail])
        used += nbytes
    if entries:
        yield from flush()


class HandleReader:
    """Maps the buckets' storages and returns their tensors as views of the trainer's memory. The mappings are kept
    for the whole sync (a storage such as Megatron's contiguous parameter buffer recurs in many buckets and is
    mapped once) and dropped by `release` at its end, which waits for this process's copies from them (torch).
    TP slices come full-shaped (buckets.in_full_shape) unless `keep_slices`: then as (name, slice, [dim, rank,
    size]), for a loader that places slices itself."""

    def __init__(self, keep_slices: bool = False) -> None:
        self.keep_slices = keep_slices
        self._open: list[torch.Tensor] = []

    def read(self, meta: dict[str, Any]) -> list[tuple]:
        from rollout_adapters.cuda_ipc import open_cuda_buffer

        opened = [open_cuda_buffer(base64.b64decode(h)) for h in meta["storages"]]  # torch caches live mappings
        self._open.extend(opened)
        named: list[tuple] = []
        for name, dtype, shape, stride, offset, storage, *tp_slice in meta["entries"]:
            raw = opened[storage]
            dt = getattr(torch, dtype)
            size = torch.empty((), dtype=dt).element_size()
            typed = raw[: raw.numel() - raw.numel() % size].view(dt)
            tensor = typed.as_strided(shape, stride, offset)  # a view: vLLM's layer-wise buffering copies views
            if tp_slice and self.keep_slices:
                named.append((name, tensor, tp_slice[0]))
            else:
                named.append((name, in_full_shape(tensor, *tp_slice[0]) if tp_slice else tensor))
        return named

    def release(self) -> None:
        """Drop this process's mappings (the sender's storages it freed meanwhile are returned to its allocator
        once no receiver maps them: torch.cuda.ipc_collect on the sender)."""
        self._open = []

