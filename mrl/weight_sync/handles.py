"""`ipc` with `one_copy` on CUDA: the buckets are the trainer's own memory, not flat buffers.

Instead of copying the stream into a shared buffer (which the engine then copies into its parameters: two device
copies), the sender shares the CUDA IPC handle of each tensor's storage (once per mapping) and describes the
tensor as a strided view of it; the engine maps the storages and copies every tensor straight from the trainer's
memory into its parameters: one device copy. Handles go this way round because vLLM's sleep-mode allocator maps
the engine's weights through cuMemCreate without a shareable handle type, which CUDA IPC cannot export.

A bucket holds at most `bucket_bytes` of tensors (a larger tensor is a bucket alone); the sender keeps the bucket's
fresh tensors alive until every receiver acknowledged it, so at most two buckets of them are held, and small fresh
tensors (biases, split q/k/v without row blocks) are copied into a two-slot staging ring that stays mapped for the
whole sync (`share_buckets` says which storages stay mapped and why that matters). A bucket of views only (a
Megatron export with row blocks: every tensor a view of the parameter buffers) holds nothing, so the sender does
not wait for it: it announces every bucket as fast as it can and waits for the receivers at the end only.
Entries are `[name, dtype, shape, stride, offset, storage]` (+ `[dim, rank, size]` for a TP slice, as in
buckets.py; + `[tp slice or None, 1]` for row blocks): `offset` in elements of `dtype` from the start of storage
number `storage`, whose handle (base64 of `mrl.weight_sync.cuda_ipc.share_cuda_buffer`) came in the `storages` of
this bucket or of an earlier one. Row blocks (bridges.export.ROW_BLOCKS: fused QKV's q/k/v as [groups, rows,
*rest] views of linear_qkv) travel as those views, so the sender copies nothing; the receiver's loader copies
them block-wise into place, or the reader flattens them (a copy) for a loader that takes HF tensors only.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch

from bridges.export import ROW_BLOCKS, stream_tags
from mrl.weight_sync.buckets import in_full_shape

# Tensors of their own storage below this size travel in the bucket's slot of the staging ring (see share_buckets).
STAGE_BELOW = 64 << 20
# The most bytes one ring slot stages (a bucket whose small fresh tensors would exceed it ends early).
STAGE_SLOT_BYTES = 256 << 20
# The first bucket's limit; each next one's doubles up to bucket_bytes. The receiver starts mapping and copying
# once the first bucket is announced, so a small first bucket starts the device copies early, while the sender
# still walks the stream (0: every bucket bucket_bytes).
FIRST_BUCKET_BYTES = 128 << 20


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
    stage_below: int | None = None, ring: list[torch.Tensor] | None = None, first_bucket: int | None = None,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Group the stream into buckets of ≤ `bucket_bytes`; yield (bucket index, meta: entries, new storages).
    `held[k % len(held)]` keeps bucket k's transient tensors alive; before bucket k reuses a slot that bucket
    k - len(held) left holding tensors or staged bytes, `before_reuse(k)` (the transport's wait for the receivers
    of that bucket) runs and the slot is cleared; a slot left empty is reused without waiting (views of kept
    storages need no keeping: torch's CUDA IPC keeps a shared storage alive while a receiver maps it).
    `counts` gets the buckets and storage handles shared, staged bytes, and the waits (`reuse_waits`).

    torch's CUDA IPC counts one consumer per share, so every storage is shared once per mapping, and dropping a
    mapping makes the receiver wait for every copy it has queued (torch synchronises its stream): a mapping
    dropped per bucket would serialise the receiver's copies with its next bucket's work. So:
    - a storage the tensor does not fill (a view into e.g. Megatron's contiguous parameter buffer) is shared once
      per sync and kept mapped by the receiver to the end;
    - a tensor that fills a storage of its own (the export's split q/k/v, biases) under `stage_below` bytes
      (default STAGE_BELOW) is copied into the staging buffer of its bucket's slot, `ring[k % len(held)]`
      (allocated on first use, STAGE_SLOT_BYTES or the bucket size if smaller; reused under the same
      `before_reuse` as `held`; shared once per sync and kept mapped); the copy is queued at once, so such
      tensors are not held;
    - a larger one is mapped for its bucket only (`transient`) and shared again should a later bucket need it.
    `ring` (default: a list of this call's own) lets the caller keep the staging buffers to the end of the sync.
    `share` (default: CUDA IPC, which needs every tensor on the device) makes a storage's handle. Bucket k holds
    at most min(bucket_bytes, first_bucket << k) (`first_bucket` default FIRST_BUCKET_BYTES; 0: no ramp)."""
    from mrl.weight_sync.cuda_ipc import share_cuda_buffer

    cuda = share is None
    share = share or share_cuda_buffer
    stage_below = STAGE_BELOW if stage_below is None else stage_below
    slot_bytes = min(bucket_bytes, STAGE_SLOT_BYTES)
    ring = [] if ring is None else ring
    counts = {} if counts is None else counts
    counts.update(buckets=0, handles=0, staged_bytes=0, reuse_waits=0)
    slot_staged = [False] * len(held)  # whether the slot's last bucket staged tensors in its ring buffer
    kept: dict[int, int] = {}  # storage address -> index, for the whole sync
    ring_index: dict[int, int] = {}  # ring slot -> its storage index in this sync
    k, used, staged, entries, storages, transient, seen = 0, 0, 0, [], {}, {}, set()
    first_bucket = FIRST_BUCKET_BYTES if first_bucket is None else first_bucket
    limit = min(bucket_bytes, first_bucket) if first_bucket else bucket_bytes

    def add_storage(t: torch.Tensor, keep: bool) -> int:
        index = counts["handles"] + len(storages)
        (kept if keep else transient)[t.untyped_storage().data_ptr()] = index
        storages[str(index)] = base64.b64encode(share(_storage_bytes(t))).decode()
        return index

    def stage(entry: list, t: torch.Tensor) -> None:
        nonlocal staged
        slot = k % len(held)
        ring.extend([None] * (slot + 1 - len(ring)))
        if ring[slot] is None:
            ring[slot] = torch.empty(slot_bytes, dtype=torch.uint8, device=t.device)
        if slot not in ring_index:
            ring_index[slot] = add_storage(ring[slot], keep=True)
        n = t.numel() * t.element_size()
        with torch.no_grad():  # a caller's tensor may require grad; the ring must stay a plain leaf to be shared
            ring[slot][staged:staged + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
        slot_staged[slot] = True
        entry[3:6] = [_contiguous_strides(t.shape), staged // t.element_size(), ring_index[slot]]
        staged = _align(staged + n)
        counts["staged_bytes"] += n

    def flush() -> Iterator[tuple[int, dict[str, Any]]]:
        nonlocal k, used, staged, entries, storages, transient, limit
        yield k, {"entries": entries, "storages": storages, "transient": sorted(transient.values())}
        counts["buckets"] += 1
        counts["handles"] += len(storages)
        k, used, staged, entries, storages, transient = k + 1, 0, 0, [], {}, {}
        limit = min(bucket_bytes, 2 * limit)
        slot = k % len(held)
        if k >= len(held) and (held[slot] or slot_staged[slot]):
            before_reuse(k)
            counts["reuse_waits"] += 1
        held[slot], slot_staged[slot] = [], False  # the receivers are done with the bucket this slot carried

    dtype_names: dict[torch.dtype, str] = {}
    # Per tensor, only what the entry needs: on a slow host the sender's Python per tensor bounds a sync
    for name, t, *tags in named_tensors:
        if name in seen:
            raise ValueError(f"weight stream repeats tensor {name!r}")
        seen.add(name)
        if cuda and not t.is_cuda:
            raise ValueError(f"weight_sync.one_copy: tensor {name!r} is on {t.device}, not on the CUDA device")
        nbytes = t.nbytes
        storage = t.untyped_storage()
        key = storage.data_ptr()
        own = storage.nbytes() <= nbytes  # the tensor fills its storage
        stageable = own and nbytes < stage_below and nbytes <= slot_bytes and key not in transient
        if entries and (used + nbytes > limit or (stageable and staged + nbytes > slot_bytes)):
            yield from flush()
        index = kept.get(key, transient.get(key))
        tail: list = []
        if tags:
            tp_slice, blocks = stream_tags(tags)
            tail = [[tp_slice.dim, tp_slice.rank, tp_slice.size]] if tp_slice else []
            if blocks:
                tail = [tail[0] if tail else None, 1]
        if (dtype := dtype_names.get(t.dtype)) is None:
            dtype = dtype_names[t.dtype] = str(t.dtype).removeprefix("torch.")
        entry = [name, dtype, list(t.shape), list(t.stride()), t.storage_offset(), index, *tail]
        if index is None and stageable:
            stage(entry, t)
        else:
            if index is None:
                entry[5] = add_storage(t, keep=not own)
            if own:
                held[k % len(held)].append(t)
        entries.append(entry)
        used += nbytes
    if entries:
        yield from flush()


def typed_view(raw: torch.Tensor, dtype: str) -> torch.Tensor:
    """Storage `raw` (uint8, the whole storage) as a flat tensor of `dtype` (its whole elements)."""
    dt = getattr(torch, dtype)
    size = torch.empty((), dtype=dt).element_size()
    return raw[: raw.numel() - raw.numel() % size].view(dt)


def view_of(raw: torch.Tensor, entry: list) -> torch.Tensor:
    """The tensor of `entry` as a view of its storage `raw`: a view, so that vLLM's layer-wise buffering (which
    copies views of transport memory) copies it."""
    _, dtype, shape, stride, offset = entry[:5]
    return typed_view(raw, dtype).as_strided(shape, stride, offset)


def parts(tags: Iterable[Any]) -> tuple[list | None, bool]:
    """A kept tensor's TP slice [dim, rank, size] (or None) and whether it comes as row blocks."""
    tags = list(tags)
    return next((t for t in tags if isinstance(t, list)), None), ROW_BLOCKS in tags


# `copy_all` batches contiguous pairs under this many bytes (norms, biases) into multi-tensor kernels: their copies
# cost the host a launch each and the device next to nothing. Larger ones keep their own copy_ (a memcpy): torch's
# multi-tensor copy kernel moved 7B-sized weights about 1.3x slower than memcpy on an H200.
BATCH_BELOW = 1 << 20


def _contiguous_after(first: torch.Tensor, then: torch.Tensor) -> bool:
    """Whether `then` continues `first` in memory: same storage and dtype, both contiguous, no gap."""
    return (then.dtype == first.dtype and then.data_ptr() == first.data_ptr() + first.nbytes
            and first.is_contiguous() and then.is_contiguous()
            and then.untyped_storage().data_ptr() == first.untyped_storage().data_ptr())


def _joined(first: torch.Tensor, numel: int) -> torch.Tensor:
    return first.as_strided((numel,), (1,), first.storage_offset())


def copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each (destination, source) pair on the current stream, asynchronously, in as few launches as the layout
    allows: on a slow host the receiver's Python and launch per copy, not the device, bound a one-copy sync.
    Consecutive pairs whose destinations and sources both continue each other in memory (gate and up into a fused
    gate_up from Megatron's fused fc1) become one copy; contiguous pairs under BATCH_BELOW bytes go in one
    `torch._foreach_copy_` per dtype; the rest (row blocks, dtype casts, other devices, large tensors) one `copy_`
    each."""
    runs: list[list] = []  # per copy after joining: [first dst, first src, numel, last dst, last src, joined]
    for dst, src in pairs:
        if runs and _contiguous_after(runs[-1][3], dst) and _contiguous_after(runs[-1][4], src):
            run = runs[-1]
            run[2] += dst.numel()
            run[3], run[4], run[5] = dst, src, True  # the last parts, to test the next pair against
        else:
            runs.append([dst, src, dst.numel(), dst, src, False])
    batched: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for dst, src, numel, _, _, joined in runs:
        if joined:
            dst, src = _joined(dst, numel), _joined(src, numel)
        if (dst.dtype == src.dtype and dst.device == src.device and numel * src.element_size() < BATCH_BELOW
                and dst.is_contiguous() and src.is_contiguous()):
            dsts, srcs = batched.setdefault(dst.dtype, ([], []))
            dsts.append(dst)
            srcs.append(src)
        else:
            dst.copy_(src, non_blocking=True)
    for dsts, srcs in batched.values():
        torch._foreach_copy_(dsts, srcs, non_blocking=True)


def whole(tensor: torch.Tensor, tp_slice: list | None, blocks: bool) -> torch.Tensor:
    """The HF tensor (full-shaped, its slice in place, for a TP slice) of a kept tensor."""
    tensor = tensor.flatten(0, 1) if blocks else tensor
    return in_full_shape(tensor, *tp_slice) if tp_slice else tensor


class HandleReader:
    """Maps the buckets' storages and returns their tensors as views of the trainer's memory. A bucket's transient
    storages are dropped by `done` (before the bucket is acknowledged: the sender may then free them), the others
    by `release` at the end of the sync; dropping a mapping waits for this process's copies from it (torch)."""

    # This process's last sync: storages mapped, host seconds mapping them and dropping the mappings (dropping
    # waits for the copies from them), for benchmarks: mapping is the per-sync cost this path adds.
    last: ClassVar[dict[str, float]] = {}

    def __init__(self, keep_parts: bool = False) -> None:
        # TP slices come full-shaped (buckets.in_full_shape) and row blocks flattened unless `keep_parts`: then as
        # (name, tensor, *tags) with tags [dim, rank, size] for a slice and ROW_BLOCKS for blocks, for a loader
        # that places them itself (see `parts`)
        self.keep_parts = keep_parts
        self._open: dict[int, torch.Tensor] = {}
        # (storage, dtype) -> the storage as that dtype: one view per storage, not three per tensor (host time
        # per bucket is what the receiver adds to the copies)
        self._typed: dict[tuple[int, str], torch.Tensor] = {}
        self._transient: list[int] = []
        # wait_s: host seconds waiting for the sender to announce a bucket (the sender is behind); read_at and
        # release_at / released_at: perf_counter when each bucket was read and the mappings dropped (a timeline,
        # comparable with the sender's `announced_at` on the same host)
        self.stats = {"mapped": 0, "map_s": 0.0, "unmap_s": 0.0, "wait_s": 0.0, "read_at": [], "release_at": 0.0,
                      "released_at": 0.0}
        HandleReader.last = self.stats

    def read(self, meta: dict[str, Any]) -> list[tuple]:
        from mrl.weight_sync.cuda_ipc import open_cuda_buffer

        start = time.perf_counter()
        self.stats["read_at"].append(start)
        self._open.update({int(i): open_cuda_buffer(base64.b64decode(h)) for i, h in meta["storages"].items()})
        self.stats["mapped"] += len(meta["storages"])
        self.stats["map_s"] += time.perf_counter() - start
        self._transient = list(meta["transient"])
        named: list[tuple] = []
        for entry in meta["entries"]:
            key = (entry[5], entry[1])
            if (typed := self._typed.get(key)) is None:
                typed = self._typed[key] = typed_view(self._open[entry[5]], entry[1])
            name, tensor = entry[0], typed.as_strided(entry[2], entry[3], entry[4])
            tp_slice, blocks = entry[6] if len(entry) > 6 else None, len(entry) > 7
            if self.keep_parts:
                tags = ([tp_slice] if tp_slice else []) + ([ROW_BLOCKS] if blocks else [])
                named.append((name, tensor, *tags))
            else:
                named.append((name, whole(tensor, tp_slice, blocks)))
        return named

    def done(self) -> None:
        """The bucket is loaded: drop its transient mappings."""
        start = time.perf_counter()
        for index in self._transient:
            self._open.pop(index, None)
        self._typed = {key: view for key, view in self._typed.items() if key[0] in self._open}
        self._transient = []
        self.stats["unmap_s"] += time.perf_counter() - start

    def release(self) -> None:
        """The sync is over: drop every mapping."""
        start = time.perf_counter()
        self._open, self._typed, self._transient = {}, {}, []
        self.stats.update(release_at=start, released_at=time.perf_counter())
        self.stats["unmap_s"] += self.stats["released_at"] - start

