"""Variable-length per-sample tensors as one values tensor plus offsets (the layout THD packing consumes).

Sample i is `values[offsets[i]:offsets[i + 1]]`; `values` has shape `[total_tokens, *feature]` and `offsets` is
int64 `[n + 1]` with `offsets[0] == 0` (every operation keeps that invariant; it is not re-checked, which would
cost a device sync), on the same device as `values`. `offsets` are the `cu_seqlens` of the engine's packed (THD)
micro-batches, so packing a selection of samples is one gather and no per-token Python.

Every operation is vectorised over samples: a selection's token gather index is one scan (`gather_plan`), never
a Python loop over samples or tokens. Contiguous slices are views (no copy); any other selection materialises a
compact values tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """`offsets[0] = 0, offsets[i + 1] = lengths[0] + … + lengths[i]` (int64)."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), dim=0, out=offsets[1:])
    return offsets


def compact_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself if it owns exactly its bytes, else a compact copy: pickling a view (torch, Ray) ships its
    whole storage, so a slice of a large batch would otherwise carry the full batch."""
    owns_storage = tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes
    return tensor if owns_storage and tensor.is_contiguous() else tensor.clone(memory_format=torch.contiguous_format)


def _raw_bytes(tensor: torch.Tensor) -> tuple[np.ndarray, torch.dtype, tuple[int, ...]]:
    tensor = tensor.detach().contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy(), tensor.dtype, tuple(tensor.shape)


def _from_raw_bytes(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    # A buffer Ray hands over without copying is read-only; a tensor over it must not be written in place.
    return torch.from_numpy(data if data.flags.writeable else data.copy()).view(dtype).reshape(shape)


def _unpickle(values: tuple[Any, ...], offsets: tuple[Any, ...]) -> JaggedTensor:
    return JaggedTensor(_from_raw_bytes(*values), _from_raw_bytes(*offsets))


@dataclass(frozen=True)
class JaggedTensor:
    """`n` variable-length tensors sharing trailing feature dims, stored as values + offsets (see module doc)."""

    values: torch.Tensor
    offsets: torch.Tensor

    def __post_init__(self) -> None:
        if self.offsets.dim() != 1 or self.offsets.numel() == 0 or self.offsets.dtype != torch.int64:
            raise ValueError(
                f"offsets must be a non-empty 1-D int64 tensor, got {self.offsets.dtype} "
                f"of shape {tuple(self.offsets.shape)}"
            )
        if self.values.dim() == 0:
            raise ValueError("values must have a leading token dimension, got a 0-d tensor")

    def __reduce__(self) -> tuple[Any, ...]:
        """CPU tensors travel as raw bytes. torch pickles a tensor's storage by naming torch.storage._load_from_bytes,
        which megatron.core replaces with its own loader on import: a Megatron worker's tensors named megatron.core,
        and every process that unpickled one imported it (3 s of CPU in each sample-store unit, which stalled the
        first old-log-prob write of every run on 2 cores)."""
        if self.values.device.type != "cpu" or self.offsets.device.type != "cpu":
            return JaggedTensor, (self.values, self.offsets)
        return _unpickle, (_raw_bytes(self.values), _raw_bytes(self.offsets))

    @classmethod
    def from_list(cls, tensors: Sequence[torch.Tensor], *, like: torch.Tensor | None = None) -> JaggedTensor:
        """Pack tensors of shapes `[L_i, *feature]`. With no tensors, `like` gives dtype/device/feature shape."""
        if len(tensors) == 0:
            template = like if like is not None else torch.empty(0)
            values = template.new_empty((0, *template.shape[1:]))
            return cls(values, torch.zeros(1, dtype=torch.int64, device=values.device))
        if any(t.dim() == 0 for t in tensors):
            raise ValueError(
                "jagged samples need a length dimension; got a 0-d tensor (store scalars as a fixed field)"
            )
        values = torch.cat(list(tensors))
        lengths = torch.tensor([t.shape[0] for t in tensors], device=values.device)
        return cls(values, offsets_from_lengths(lengths))

    @classmethod
    def from_padded(cls, padded: torch.Tensor, lengths: torch.Tensor | Sequence[int]) -> JaggedTensor:
        """Inverse of `to_padded`: keep the first `lengths[i]` entries of row i of `padded` `[n, L, *feature]`."""
        lengths = torch.as_tensor(lengths, dtype=torch.int64, device=padded.device)
        if lengths.numel() != padded.shape[0] or (lengths.numel() and int(lengths.max()) > padded.shape[1]):
            raise ValueError(f"lengths {lengths.tolist()} do not fit a padded tensor of shape {tuple(padded.shape)}")
        keep = torch.arange(padded.shape[1], device=padded.device) < lengths[:, None]
        return cls(padded[keep], offsets_from_lengths(lengths))

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.values.device

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def __getitem__(self, i: int) -> torch.Tensor:
        """Sample i as a view of `values`."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        i %= n
        return self.values[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def slice(self, start: int, stop: int) -> JaggedTensor:
        """Samples `start..stop-1` as views (no copy); bounds must already be within `0..len`."""
        begin = int(self.offsets[start])
        end = int(self.offsets[stop])
        return JaggedTensor(self.values[begin:end], self.offsets[start : stop + 1] - begin)

    def gather_plan(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(offsets, source)` for selecting samples `index`: output token k is input token `source[k]`.

        `source` is a running count that jumps at each selected segment's start: ones everywhere, at the first
        output token of segment s the jump `start_in[s] - (start_in[s-1] + len[s-1] - 1)`, then a cumsum. One
        scatter and one scan, about 5x faster than `repeat_interleave` + `arange` on CPU.
        """
        index = index.to(device=self.offsets.device, dtype=torch.int64)
        lengths = self.lengths()[index]
        offsets = offsets_from_lengths(lengths)
        nonempty = lengths > 0
        starts_in, starts_out, kept = self.offsets[:-1][index][nonempty], offsets[:-1][nonempty], lengths[nonempty]
        jumps = starts_in.clone()
        jumps[1:] -= starts_in[:-1] + kept[:-1] - 1
        steps = torch.ones(int(offsets[-1]), dtype=torch.int64, device=self.offsets.device)
        steps[starts_out] = jumps
        return offsets, torch.cumsum(steps, dim=0)

    def take(self, offsets: torch.Tensor, source: torch.Tensor) -> JaggedTensor:
        """Apply a `gather_plan` (made from this tensor or from one with the same offsets)."""
        return JaggedTensor(torch.index_select(self.values, 0, source), offsets)

    def index_select(self, index: torch.Tensor) -> JaggedTensor:
        """Samples `index[0], index[1], …` (repeats allowed), packed into a new compact values tensor."""
        return self.take(*self.gather_plan(index))

    @classmethod
    def cat(cls, parts: Sequence[JaggedTensor]) -> JaggedTensor:
        if not parts:
            raise ValueError("JaggedTensor.cat needs at least one part")
        lengths = torch.cat([p.lengths() for p in parts])
        return cls(torch.cat([p.values for p in parts]), offsets_from_lengths(lengths))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedTensor:
        return JaggedTensor(
            self.values.to(device, non_blocking=non_blocking), self.offsets.to(device, non_blocking=non_blocking)
        )

    def compact(self) -> JaggedTensor:
        """Values and offsets that own exactly their bytes (copies only where they are views of more)."""
        return JaggedTensor(compact_tensor(self.values[: int(self.offsets[-1])]), compact_tensor(self.offsets))

    def to_list(self) -> list[torch.Tensor]:
        """Per-sample views, one per sample."""
        bounds = self.offsets.tolist()
        return [self.values[a:b] for a, b in itertools.pairwise(bounds)]

    def to_padded(self, pad_value: float = 0, max_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded `[n, max_length, *feature]` tensor (default: the longest sample) and the lengths."""
        lengths = self.lengths()
        longest = int(lengths.max()) if len(self) else 0
        width = longest if max_length is None else max_length
        if width < longest:
            raise ValueError(f"max_length {width} is shorter than the longest sample ({longest})")
        padded = self.values.new_full((len(self), width, *self.values.shape[1:]), pad_value)
        # Row-major order of the mask's True entries is exactly the packed order of values.
        padded[torch.arange(width, device=self.device) < lengths[:, None]] = self.values[: int(self.offsets[-1])]
        return padded, lengths

    def equal(self, other: object) -> bool:
        """Same samples: dtype, feature shape, lengths and values."""
        if not isinstance(other, JaggedTensor) or len(self) != len(other):
            return False
        end, other_end = int(self.offsets[-1]), int(other.offsets[-1])
        return (
            self.values.dtype == other.values.dtype
            and self.values.shape[1:] == other.values.shape[1:]
            and torch.equal(self.offsets.cpu(), other.offsets.cpu())
            and torch.equal(self.values[:end].cpu(), other.values[:other_end].cpu())
        )
