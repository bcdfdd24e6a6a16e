"""Fixed-size flat buckets: the wire layout of the `ipc` and `nccl` transports.

The sender copies the HF-named stream into a small ring of flat uint8 buffers (two: double buffering) and
describes each filled bucket with a JSON-able list of entries `[name, dtype, shape, offset, nbytes, start, total]`:
bytes `offset … offset+nbytes` of the bucket are bytes `start … start+nbytes` of tensor `name` (`total` bytes).
A tensor larger than a bucket is split across consecutive buckets; every other tensor lies whole in one bucket at
an aligned offset, so the receiver takes a view of the buffer instead of a copy. Only split tensors are staged
(re-assembled in their own memory) on the receiver.

A stream item may also be (name, slice, tp_slice) with `tp_slice` = (dim, rank, size) (bridges.export.TpSlice):
the sender's TP rank's slice of the tensor, for an engine rank on the same device that keeps the same slice. Its
entry carries the triple; the reader hands the engine the full-shaped tensor with the slice in place (the rest
left unset): engines' TP weight loaders narrow a full tensor to their rank's slice, which is exactly that one.
A tensor tagged as row blocks (bridges.export.ROW_BLOCKS, for the one-copy sender) is packed as its HF tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from bridges.export import stream_tags

# Offsets are rounded up so that every view is aligned for any dtype (and for vectorised copies).
ALIGN = 256

Entry = list  # [name, dtype, shape, offset, nbytes, start, total] (+ [[dim, rank, size]] for a TP slice)


def completed(entries: list[Entry]) -> int:
    """How many tensors end in these entries (the last piece of each)."""
    return sum(e[5] + e[4] == e[6] for e in entries)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's data (a contiguous copy first if it is a strided view)."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def fill_buckets(
    named_tensors: Iterable[tuple],
    buffers: list[torch.Tensor],
    before_reuse: Callable[[int], None],
) -> Iterator[tuple[int, int, list[Entry], int]]:
    """Copy the stream into `buffers` in turn; yield (bucket index, buffer index, entries, bytes used) per bucket.

    `before_reuse(k)` is called before bucket k is written into a buffer that already carried bucket k - len(buffers)
    (the transport waits there until every receiver is done with it). The copies are issued on the current stream;
    the caller synchronises before it announces a bucket.
    """
    capacity = buffers[0].numel()
    k, used, entries = 0, 0, []
    seen: set[str] = set()

    def flush() -> Iterator[tuple[int, int, list[Entry], int]]:
        nonlocal k, used, entries
        yield k, k % len(buffers), entries, used
        k, used, entries = k + 1, 0, []
        if k >= len(buffers):
            before_reuse(k)

    for name, tensor, *tags in named_tensors:
        if name in seen:
            raise ValueError(f"weight stream repeats tensor {name!r}")
        seen.add(name)
        tp_slice, blocks = stream_tags(tags)
        if blocks:
            tensor = tensor.flatten(0, 1)
        total, done = tensor.numel() * tensor.element_size(), 0
        flat: torch.Tensor | None = None  # flattened only if the tensor is split
        meta = [name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]
        tail = [[tp_slice.dim, tp_slice.rank, tp_slice.size]] if tp_slice else []
        while done < total or (total == 0 and done == 0):
            start = _align(used)
            room = capacity - start
            # A tensor that fits in a bucket is never split: close this bucket and start the next one.
            if room <= 0 or (done == 0 and total <= capacity and total > room):
                yield from flush()
                continue
            n = min(total - done, room)
            dst = buffers[k % len(buffers)][start : start + n]
            if n == total and total:  # whole: one (possibly strided) copy straight into the bucket
                dst.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach(), non_blocking=True)
            else:
                flat = as_bytes(tensor) if flat is None else flat
                dst.copy_(flat[done : done + n], non_blocking=True)
            entries.append([*meta, start, n, done, total, *tail])
            used, done = start + n, done + n
            if total == 0:
                break
    if entries:
        yield from flush()


class BucketReader:
    """Turns received buckets back into (name, tensor) pairs: views of the buffer for whole tensors, staged
    copies for tensors split across buckets (returned once their last piece has arrived)."""

    def __init__(self) -> None:
        self._staged: dict[str, torch.Tensor] = {}

    def read(self, buffer: torch.Tensor, entries: list[Entry]) -> list[tuple[str, torch.Tensor]]:
        named = []
        for name, dtype, shape, offset, nbytes, start, total, *tp_slice in entries:
            piece = buffer[offset : offset + nbytes]
            if nbytes != total:
                staged = self._staged.get(name)
                if staged is None:
                    staged = self._staged[name] = torch.empty(total, dtype=torch.uint8, device=buffer.device)
                staged[start : start + nbytes].copy_(piece)
                if start + nbytes < total:
                    continue
                piece = self._staged.pop(name)
            tensor = piece.view(getattr(torch, dtype)).view(shape)
            named.append((name, in_full_shape(tensor, *tp_slice[0]) if tp_slice else tensor))
        return named

    def check_complete(self) -> None:
        if self._staged:
            raise RuntimeError(f"weight stream ended inside split tensors {sorted(self._staged)}")


def in_full_shape(piece: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """The full-shaped tensor whose TP slice `rank` of `size` along `dim` is `piece` (the rest is not set)."""
    shape = list(piece.shape)
    shape[dim] *= size
    full = torch.empty(shape, dtype=piece.dtype, device=piece.device)
    full.narrow(dim, rank * piece.shape[dim], piece.shape[dim]).copy_(piece)
    return full
