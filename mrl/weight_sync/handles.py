"""`ipc` with `one_copy` on CUDA: the buckets are the trainer's own memory, not flat buffers.

Instead of copying the stream into a shared buffer (which the engine then copies into its parameters: two device
copies), the sender shares the CUDA IPC handle of each tensor's storage (once per mapping) and describes the
tensor as a strided view of it; the engine maps the storages and copies every tensor straight from the trainer's
memory into its parameters: one device copy. Handles go this way round because vLLM's sleep-mode allocator maps
the engine's weights through cuMemCreate without a shareable handle type, which CUDA IPC cannot export.

A bucket holds at most `bucket_bytes` of tensors (a larger tensor is a bucket alone); the sender keeps the bucket's
tensors alive until every receiver acknowledged it (tensors the export created, e.g. split fused QKV, are freed
then), so at most two buckets of fresh tensors are held (`share_buckets` says which storages stay mapped).
Entries are `[name, dtype, shape, stride, offset, storage]` (+ `[dim, rank, size]` for a TP slice, as in
buckets.py): `offset` in elements of `dtype` from the start of storage number `storage`, whose handle (base64 of
`rollout_adapters.cuda_ipc.share_cuda_buffer`) came in the `storages` of this bucket or of an earlier one.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch

from mrl.weight_sync.buckets import in_full_shape

# Tensors of their own storage below this size travel in a per-bucket staging tensor (see share_buckets).
STAGE_BELOW = 64 << 20


def _align(n: int, to: int = 256) -> int:
    return -(-n // to) * to


def _contiguous_strides(shape: list[int] | torch.Size) -> list[int]:
    strides, step = [], 1
    for n in reversed(list(shape)):
        strides.insert(0, step)
        step *= n
    return strides


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)


def share_buckets(
    named_tensors: Iterable[tuple], bucket_bytes: int, before_reuse: Callable[[int], None], held: list[list],
    counts: dict[str, int] | None = None, share: Callable[[torch.Tensor], bytes] | None = None,
    stage_below: int | None = None,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Group the stream into buckets of ≤ `bucket_bytes`; yield (bucket index, meta: entries, new storages).
    `held[k % len(held)]` keeps bucket k's tensors alive; it is cleared after `before_reuse(k)` (the transport's
    wait for the receivers of bucket k - len(held)). `counts` gets the buckets and storage handles shared.

    torch's CUDA IPC counts one consumer per share, so every storage is shared once per mapping: a storage the
    tensor does not fill (a view into e.g. Megatron's contiguous parameter buffer) is shared once per sync and
    kept mapped by the receiver to the end; a storage the tensor fills (the export's own tensors, a parameter of
    its own) is mapped for its bucket only (`transient`) and shared again should a later bucket need it. Such
    tensors under `stage_below` bytes (default STAGE_BELOW; the export's split q/k/v, biases) are first copied
    into one staging tensor per bucket: a few handles per sync instead of one per tensor (each costs both sides
    tens of µs of host time).
    `share` (default: CUDA IPC, which needs every tensor on the device) makes a storage's handle."""
    from rollout_adapters.cuda_ipc import share_cuda_buffer

    cuda = share is None
    share = share or share_cuda_buffer
    stage_below = STAGE_BELOW if stage_below is None else stage_below
    counts = {} if counts is None else counts
    counts.update(buckets=0, handles=0)
    kept: dict[int, int] = {}  # storage address -> index, for the whole sync
    k, used, entries, storages, transient, seen = 0, 0, [], {}, {}, set()
    staged: list[tuple[list, torch.Tensor]] = []  # (entry, tensor) to copy into the bucket's staging tensor

    def add_storage(t: torch.Tensor, keep: bool) -> int:
        index = counts["handles"] + len(storages)
        (kept if keep else transient)[t.untyped_storage().data_ptr()] = index
        storages[str(index)] = base64.b64encode(share(_storage_bytes(t))).decode()
        return index

    def stage() -> None:
        offsets, total = [], 0
        for _, t in staged:
            offsets.append(total)
            total = _align(total + t.numel() * t.element_size())
        staging = torch.empty(total, dtype=torch.uint8, device=staged[0][1].device)
        index = add_storage(staging, keep=False)
        for (entry, t), offset in zip(staged, offsets):
            n = t.numel() * t.element_size()
            staging[offset:offset + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
            entry[3:6] = [_contiguous_strides(t.shape), offset // t.element_size(), index]
        held[k % len(held)].append(staging)
        staged.clear()

    def flush() -> Iterator[tuple[int, dict[str, Any]]]:
        nonlocal k, used, entries, storages, transient
        if staged:
            stage()
        yield k, {"entries": entries, "storages": storages, "transient": sorted(transient.values())}
        counts["buckets"] += 1
        counts["handles"] += len(storages)
        k, used, entries, storages, transient = k + 1, 0, [], {}, {}
        if k >= len(held):
            before_reuse(k)
        held[k % len(held)] = []  # the receivers are done with the bucket this slot carried

    for name, tensor, *tp_slice in named_tensors:
        if name in seen:
            raise ValueError(f"weight stream repeats tensor {name!r}")
        seen.add(name)
        t = tensor.detach()
        if cuda and t.device.type != "cuda":
            raise ValueError(f"weight_sync.one_copy: tensor {name!r} is on {t.device}, not on the CUDA device")
        nbytes = t.numel() * t.element_size()
        if entries and used + nbytes > bucket_bytes:
            yield from flush()
        storage = t.untyped_storage()
        key = storage.data_ptr()
        index = kept.get(key, transient.get(key))
        own = storage.nbytes() <= nbytes  # the tensor fills its storage
        tail = [[tp_slice[0].dim, tp_slice[0].rank, tp_slice[0].size]] if tp_slice else []
        entry = [name, str(t.dtype).removeprefix("torch."), list(t.shape), list(t.stride()), t.storage_offset(),
                 index, *tail]
        if index is None and own and nbytes < stage_below:
            staged.append((entry, t))
        elif index is None:
            entry[5] = add_storage(t, keep=not own)
        held[k % len(held)].append(t)
        entries.append(entry)
        used += nbytes
    if entries:
        yield from flush()


def view_of(raw: torch.Tensor, entry: list) -> torch.Tensor:
    """The tensor of `entry` as a view of its storage `raw` (uint8, the whole storage): a view, so that vLLM's
    layer-wise buffering (which copies views of transport memory) copies it."""
    _, dtype, shape, stride, offset = entry[:5]
    dt = getattr(torch, dtype)
    size = torch.empty((), dtype=dt).element_size()
    return raw[: raw.numel() - raw.numel() % size].view(dt).as_strided(shape, stride, offset)


class HandleReader:
    """Maps the buckets' storages and returns their tensors as views of the trainer's memory. A bucket's transient
    storages are dropped by `done` (before the bucket is acknowledged: the sender may then free them), the others
    by `release` at the end of the sync; dropping a mapping waits for this process's copies from it (torch)."""

    # This process's last sync: storages mapped, host seconds mapping them and dropping the mappings (dropping
    # waits for the copies from them), for benchmarks: mapping is the per-sync cost this path adds.
    last: ClassVar[dict[str, float]] = {}

    def __init__(self, keep_slices: bool = False) -> None:
        # TP slices come full-shaped (buckets.in_full_shape) unless `keep_slices`: then as (name, slice, [dim,
        # rank, size]), for a loader that places slices itself
        self.keep_slices = keep_slices
        self._open: dict[int, torch.Tensor] = {}
        self._transient: list[int] = []
        self.stats = {"mapped": 0, "map_s": 0.0, "unmap_s": 0.0}
        HandleReader.last = self.stats

    def read(self, meta: dict[str, Any]) -> list[tuple]:
        from rollout_adapters.cuda_ipc import open_cuda_buffer

        start = time.perf_counter()
        self._open.update({int(i): open_cuda_buffer(base64.b64decode(h)) for i, h in meta["storages"].items()})
        self.stats["mapped"] += len(meta["storages"])
        self.stats["map_s"] += time.perf_counter() - start
        self._transient = list(meta["transient"])
        named: list[tuple] = []
        for entry in meta["entries"]:
            name, tensor, tp_slice = entry[0], view_of(self._open[entry[5]], entry), entry[6:]
            if tp_slice and self.keep_slices:
                named.append((name, tensor, tp_slice[0]))
            else:
                named.append((name, in_full_shape(tensor, *tp_slice[0]) if tp_slice else tensor))
        return named

    def done(self) -> None:
        """The bucket is loaded: drop its transient mappings."""
        start = time.perf_counter()
        for index in self._transient:
            self._open.pop(index, None)
        self._transient = []
        self.stats["unmap_s"] += time.perf_counter() - start

    def release(self) -> None:
        """The sync is over: drop every mapping."""
        start = time.perf_counter()
        self._open, self._transient = {}, []
        self.stats["unmap_s"] += time.perf_counter() - start

