"""`Batch`: the per-sample container that crosses dispatch, the sample store and the algorithms.

A batch of `n` samples holds four kinds of data, one flat namespace of keys across them:

- fixed-shape fields `[n, *shape]` (scores, advantages per sample, lengths) in a `TensorDict` with
  `batch_size=[n]`: tensordict already does indexing by int / slice / index tensor, `torch.cat` and device moves
  well, so those are used as they are;
- jagged fields (token ids, masks, log-probs per token) as `JaggedTensor` values + offsets (`mrl/data/jagged.py`),
  unpadded until the engine packs them into THD micro-batches. Not tensordict's nested tensors: with
  tensordict 0.15.3 / torch 2.13 `repeat_interleave` of a TensorDict holding a jagged nested tensor raises
  (measured), GRPO needs exactly that repeat, and the engine wants the offsets as `cu_seqlens` anyway;
- non-tensor fields (uids, raw prompts, tool kwargs) as 1-D numpy arrays, object dtype for arbitrary objects:
  one Python object per sample, never per token;
- `meta_info`, a dict that describes the whole batch and is never split.

Operations never loop over samples or tokens in Python (contiguous slices are views; any other selection is one
gather per field). Pickling (Ray) ships compact copies of tensors: a pickled view carries its whole storage
(measured: 10 rows sliced from a 1,000-row TensorDict pickle to the size of all 1,000), so without compaction
every DP chunk would carry the full batch to its worker.

Padding here (`pad_to_divisible`) is dispatch padding: rows copied from the batch itself so that read-only calls
(log-probs, values) split evenly, removed again with `unpad` on collect. Training batches never carry it; the
trainer makes their counts divisible with no-op samples whose loss mask is zero (DESIGN.md, two kinds of padding).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from mrl.data.jagged import JaggedTensor, compact_tensor

Field = torch.Tensor | JaggedTensor | np.ndarray
Index = int | slice | torch.Tensor | np.ndarray | Sequence[int]


def _object_array(values: Sequence[Any]) -> np.ndarray:
    # Filled element by element so that equal-length lists stay one object each, not a 2-D array.
    array = np.empty(len(values), dtype=object)
    array[:] = list(values) if len(values) else []
    return array


def _as_field(value: Any) -> Field:
    """The storage kind of a column: Tensor → fixed, JaggedTensor / list of tensors → jagged, other → non-tensor."""
    if isinstance(value, torch.Tensor | JaggedTensor):
        return value
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError("a non-tensor field needs one entry per sample, got a 0-d array")
        return value
    if isinstance(value, list | tuple):
        if value and all(isinstance(v, torch.Tensor) for v in value):
            return JaggedTensor.from_list(value)
        return _object_array(value)
    raise TypeError(f"cannot store a {type(value).__name__} as a per-sample field; use meta_info for batch-level data")


def values_equal(a: Any, b: Any) -> bool:
    """Deep equality for field and meta_info values (tensors exactly, with dtype; containers element-wise)."""
    if isinstance(a, JaggedTensor):
        return a.equal(b)
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, np.ndarray):
        if not isinstance(b, np.ndarray) or a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(values_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))
        return bool(np.array_equal(a, b))
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False


def _merge_meta(metas: Sequence[Mapping[str, Any]], operation: str) -> dict[str, Any]:
    """Union of meta_info dicts; a key present in several must hold equal values there."""
    merged: dict[str, Any] = {}
    for meta in metas:
        for key, value in meta.items():
            if key in merged and not values_equal(merged[key], value):
                raise ValueError(
                    f"{operation}: meta_info[{key!r}] differs between batches ({merged[key]!r} vs {value!r}); "
                    "aggregate per-part values (e.g. metrics) before merging batches"
                )
            merged.setdefault(key, value)
    return merged


class Batch:
    """`n` samples: fixed-shape tensors, jagged tensors, non-tensor fields, plus unsplit `meta_info`.

    Indexing: `batch["key"]` → the field; `batch[i]` → dict of sample i (views); a slice / list / index tensor /
    bool mask → a new `Batch` of those samples (contiguous slices share storage, other selections copy).
    Derived batches get a shallow copy of `meta_info`.
    """

    def __init__(
        self,
        tensors: TensorDict | Mapping[str, torch.Tensor] | None = None,
        jagged: Mapping[str, JaggedTensor] | None = None,
        non_tensors: Mapping[str, np.ndarray | Sequence[Any]] | None = None,
        meta_info: Mapping[str, Any] | None = None,
        *,
        batch_size: int | None = None,
    ) -> None:
        tensors = dict(tensors.items()) if tensors is not None else {}
        self.jagged: dict[str, JaggedTensor] = dict(jagged or {})
        self.non_tensors: dict[str, np.ndarray] = {
            k: v if isinstance(v, np.ndarray) else _object_array(v) for k, v in (non_tensors or {}).items()
        }
        self.meta_info: dict[str, Any] = dict(meta_info or {})
        scalars = [k for k, t in tensors.items() if t.dim() == 0]
        if scalars:
            raise ValueError(
                f"fields {scalars} are 0-d tensors; per-sample fields need a leading sample dimension "
                "(batch-level values belong in meta_info)"
            )
        sizes = {k: t.shape[0] for k, t in tensors.items()}
        sizes |= {k: len(j) for k, j in self.jagged.items()} | {k: len(a) for k, a in self.non_tensors.items()}
        n = batch_size if batch_size is not None else next(iter(sizes.values()), 0)
        for key, size in sizes.items():
            if size != n:
                raise ValueError(f"field {key!r} has {size} samples but the batch has {n}")
        duplicated = (tensors.keys() & self.jagged.keys()) | (self.non_tensors.keys() & (tensors | self.jagged).keys())
        if duplicated:
            raise ValueError(f"fields {sorted(duplicated)} are given as more than one kind")
        self.tensors = TensorDict(tensors, batch_size=[n])

    # ---- construction -------------------------------------------------------------------------------------------

    @classmethod
    def from_dict(
        cls, columns: Mapping[str, Any], meta_info: Mapping[str, Any] | None = None, *, batch_size: int | None = None
    ) -> Batch:
        """Columns by kind: Tensor → fixed; JaggedTensor or list of tensors → jagged; array or other list →
        non-tensor."""
        fields = {key: _as_field(value) for key, value in columns.items()}
        return cls(
            {k: v for k, v in fields.items() if isinstance(v, torch.Tensor)},
            {k: v for k, v in fields.items() if isinstance(v, JaggedTensor)},
            {k: v for k, v in fields.items() if isinstance(v, np.ndarray)},
            meta_info,
            batch_size=batch_size,
        )

    @classmethod
    def from_lists(
        cls,
        samples: Sequence[Mapping[str, Any]],
        meta_info: Mapping[str, Any] | None = None,
        *,
        fixed_keys: Sequence[str] = (),
    ) -> Batch:
        """Rows → columns. Every sample must have the same keys. Per key: tensors with a length dim → jagged
        (whatever their lengths, so a field's kind never depends on the data), except keys in `fixed_keys` and
        0-d tensors, which are stacked; Python numbers → a fixed tensor; anything else → a non-tensor field."""
        keys = list(samples[0].keys()) if samples else []
        columns: dict[str, Any] = {}
        for key in keys:
            missing = [i for i, sample in enumerate(samples) if key not in sample]
            if missing:
                raise KeyError(f"sample {missing[0]} has no key {key!r} (sample 0 has {keys})")
            column = [sample[key] for sample in samples]
            if all(isinstance(v, torch.Tensor) for v in column):
                stack = key in fixed_keys or all(v.dim() == 0 for v in column)
                columns[key] = torch.stack(column) if stack else JaggedTensor.from_list(column)
            elif all(isinstance(v, numbers.Number) for v in column):
                columns[key] = torch.tensor(column)
            else:
                columns[key] = _object_array(column)
        extra = [i for i, sample in enumerate(samples) if sample.keys() - set(keys)]
        if extra:
            raise KeyError(f"sample {extra[0]} has keys {sorted(samples[extra[0]].keys() - set(keys))} not in sample 0")
        return cls.from_dict(columns, meta_info, batch_size=len(samples))

    # ---- fields -------------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.tensors.batch_size[0])

    def keys(self) -> list[str]:
        return [*self.tensors.keys(), *self.jagged.keys(), *self.non_tensors.keys()]

    def items(self) -> Iterator[tuple[str, Field]]:
        yield from self.tensors.items()
        yield from self.jagged.items()
        yield from self.non_tensors.items()

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.jagged or key in self.non_tensors

    def __setitem__(self, key: str, value: Any) -> None:
        """Add or replace a field (kind chosen as in `from_dict`); its sample count must be `len(self)`."""
        field = _as_field(value)
        size = field.shape[0] if isinstance(field, torch.Tensor | np.ndarray) else len(field)
        if size != len(self):
            raise ValueError(f"field {key!r} has {size} samples but the batch has {len(self)}")
        if key in self:
            del self[key]
        if isinstance(field, torch.Tensor):
            self.tensors[key] = field
        elif isinstance(field, JaggedTensor):
            self.jagged[key] = field
        else:
            self.non_tensors[key] = field

    def __delitem__(self, key: str) -> None:
        if key in self.jagged:
            del self.jagged[key]
        elif key in self.non_tensors:
            del self.non_tensors[key]
        elif key in self.tensors:
            del self.tensors[key]
        else:
            raise KeyError(self._missing(key))

    def _missing(self, key: str) -> str:
        return f"no field {key!r}; the batch has {sorted(self.keys())}"

    def as_list(self, key: str) -> list[Any]:
        """Field `key` as one entry per sample (tensor views for tensor fields)."""
        field = self[key]
        if isinstance(field, JaggedTensor):
            return field.to_list()
        return list(field.unbind(0)) if isinstance(field, torch.Tensor) else list(field)

    def as_padded(
        self, key: str, pad_value: float = 0, max_length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Jagged field `key` right-padded to `[n, max_length, *feature]`, plus the per-sample lengths."""
        return self.jagged_field(key).to_padded(pad_value, max_length)

    def jagged_field(self, key: str) -> JaggedTensor:
        if key not in self.jagged:
            kind = "missing" if key not in self else "not jagged"
            raise KeyError(f"field {key!r} is {kind}; jagged fields are {sorted(self.jagged)}")
        return self.jagged[key]

    # ---- indexing -----------------------------------------------------------------------------------------------

    def __getitem__(self, index: str | Index) -> Any:
        if isinstance(index, str):
            for group in (self.jagged, self.non_tensors):
                if index in group:
                    return group[index]
            if index in self.tensors:
                return self.tensors[index]
            raise KeyError(self._missing(index))
        if isinstance(index, torch.Tensor) and index.dim() == 0 and index.dtype != torch.bool:
            index = int(index)
        if isinstance(index, numbers.Integral):
            n = len(self)
            if not -n <= index < n:
                raise IndexError(f"sample {index} out of range for a batch of {n}")
            i = int(index) % n
            row = dict(self.tensors[i].items())
            row |= {k: j[i] for k, j in self.jagged.items()} | {k: a[i] for k, a in self.non_tensors.items()}
            return row
        return self._take(index)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))

    def _take(self, index: Index) -> Batch:
        n = len(self)
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step == 1:
                stop = max(start, stop)
                return Batch(
                    self.tensors[start:stop],
                    {k: j.slice(start, stop) for k, j in self.jagged.items()},
                    {k: a[start:stop] for k, a in self.non_tensors.items()},
                    self.meta_info,
                    batch_size=stop - start,
                )
            selected = range(start, stop, step)
            index = torch.arange(start, stop, step) if len(selected) else torch.zeros(0, dtype=torch.int64)
        if isinstance(index, list | tuple):
            index = np.asarray(index) if index else np.zeros(0, dtype=np.int64)
        index = torch.as_tensor(index)
        if index.is_floating_point():
            raise TypeError(f"sample indices must be integers or booleans, got {index.dtype}")
        if index.dtype == torch.bool:
            if index.shape != (n,):
                raise IndexError(f"a boolean mask must have shape ({n},), got {tuple(index.shape)}")
            index = index.nonzero().flatten()
        index = index.to(device="cpu", dtype=torch.int64).flatten()
        if index.numel() and (int(index.min()) < -n or int(index.max()) >= n):
            raise IndexError(f"index {index.tolist()} out of range for a batch of {n}")
        index = torch.where(index < 0, index + n, index)
        return Batch(
            self.tensors[index],
            {k: j.index_select(index) for k, j in self.jagged.items()},
            {k: a[index.numpy()] for k, a in self.non_tensors.items()},
            self.meta_info,
            batch_size=index.numel(),
        )

    # ---- dispatch protocol (duck-typed by mrl.controller: chunk, concat, pad_to_divisible, unpad, __len__) --------

    def chunk(self, chunks: int) -> list[Batch]:
        """`chunks` equal consecutive parts (views); `len(self)` must be divisible by `chunks`."""
        n = len(self)
        if chunks <= 0:
            raise ValueError(f"chunk needs a positive number of parts, got {chunks}")
        if n % chunks:
            raise ValueError(
                f"cannot chunk a batch of {n} samples into {chunks} equal parts ({n} % {chunks} = {n % chunks}); "
                f"pad_to_divisible({chunks}) first"
            )
        size = n // chunks
        return [self[i * size : (i + 1) * size] for i in range(chunks)]

    @classmethod
    def concat(cls, batches: Sequence[Batch]) -> Batch:
        """Samples of all `batches` in order. All must have the same fields of the same kinds; meta_info is the
        union of theirs, and a key present in several must hold equal values."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        layout = batches[0]._layout()
        for i, batch in enumerate(batches[1:], start=1):
            if batch._layout() != layout:
                raise ValueError(f"cannot concat: batch {i} has fields {batch._layout()} but batch 0 has {layout}")
        first = batches[0]
        return cls(
            torch.cat([b.tensors for b in batches]),
            {k: JaggedTensor.cat([b.jagged[k] for b in batches]) for k in first.jagged},
            {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors},
            _merge_meta([b.meta_info for b in batches], "concat"),
            batch_size=sum(len(b) for b in batches),
        )

    def _layout(self) -> dict[str, list[str]]:
        return {
            "fixed": sorted(self.tensors.keys()),
            "jagged": sorted(self.jagged),
            "non_tensor": sorted(self.non_tensors),
        }

    def pad_to_divisible(self, divisor: int) -> tuple[Batch, int]:
        """`(batch, pad_count)` with `len(batch) % divisor == 0`: the first `pad_count` samples appended again
        (cyclically when the batch is shorter than the padding). For read-only calls only; see `unpad`."""
        if divisor <= 0:
            raise ValueError(f"pad_to_divisible needs a positive divisor, got {divisor}")
        n = len(self)
        pad_count = -n % divisor
        if pad_count == 0:
            return self, 0
        # Concatenation copies the bulk with memcpy; only the few padding rows need a gather.
        return Batch.concat([self, self[torch.arange(pad_count) % n]]), pad_count

    def unpad(self, pad_count: int) -> Batch:
        """Drop the last `pad_count` samples (the rows `pad_to_divisible` added, after a collect)."""
        if not 0 <= pad_count <= len(self):
            raise ValueError(f"cannot remove {pad_count} padding samples from a batch of {len(self)}")
        return self if pad_count == 0 else self[: len(self) - pad_count]

    # ---- algebra ------------------------------------------------------------------------------------------------

    def repeat(self, repeats: int, interleave: bool = True) -> Batch:
        """Each sample `repeats` times: interleaved `[a, a, b, b]` (GRPO groups stay adjacent) or tiled
        `[a, b, a, b]`."""
        if repeats <= 0:
            raise ValueError(f"repeat needs a positive count, got {repeats}")
        order = torch.arange(len(self))
        return self[order.repeat_interleave(repeats) if interleave else order.repeat(repeats)]

    def select(self, keys: Sequence[str] | None = None, meta_info_keys: Sequence[str] | None = None) -> Batch:
        """A batch with only `keys` (all when None) and `meta_info_keys` (all when None); tensors are shared."""
        keys = self.keys() if keys is None else list(keys)
        unknown = [k for k in keys if k not in self]
        if unknown:
            raise KeyError(f"no fields {unknown}; the batch has {sorted(self.keys())}")
        meta_keys = self.meta_info.keys() if meta_info_keys is None else meta_info_keys
        missing_meta = [k for k in meta_keys if k not in self.meta_info]
        if missing_meta:
            raise KeyError(f"no meta_info keys {missing_meta}; meta_info has {sorted(self.meta_info)}")
        return Batch(
            self.tensors.select(*[k for k in keys if k in self.tensors]),
            {k: self.jagged[k] for k in keys if k in self.jagged},
            {k: self.non_tensors[k] for k in keys if k in self.non_tensors},
            {k: self.meta_info[k] for k in meta_keys},
            batch_size=len(self),
        )

    def union(self, other: Batch) -> Batch:
        """A new batch with the fields and meta_info of both (neither input changes). Same length; a key present
        in both must hold equal values of the same kind."""
        if len(self) != len(other):
            raise ValueError(f"union of batches with {len(self)} and {len(other)} samples")
        merged = self.select()
        for key, field in other.items():
            if key in merged:
                if not values_equal(merged[key], field):
                    raise ValueError(f"union: field {key!r} differs between the two batches")
            else:
                merged[key] = field
        merged.meta_info = _merge_meta([self.meta_info, other.meta_info], "union")
        return merged

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            self.tensors.to(device, non_blocking=non_blocking),
            {k: j.to(device, non_blocking=non_blocking) for k, j in self.jagged.items()},
            self.non_tensors,
            self.meta_info,
            batch_size=len(self),
        )

    def equal(self, other: object) -> bool:
        """Same fields (kinds, dtypes, values) and equal meta_info."""
        return (
            isinstance(other, Batch)
            and len(self) == len(other)
            and self._layout() == other._layout()
            and all(values_equal(field, other[key]) for key, field in self.items())
            and values_equal(self.meta_info, other.meta_info)
        )

    # ---- serialization (pickle, Ray) -------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return {
            "batch_size": len(self),
            "tensors": {k: compact_tensor(t) for k, t in self.tensors.items()},
            "jagged": {k: j.compact() for k, j in self.jagged.items()},
            "non_tensors": self.non_tensors,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["tensors"], state["jagged"], state["non_tensors"], state["meta_info"], batch_size=state["batch_size"]
        )

    def __repr__(self) -> str:
        fields = [f"{k}: {tuple(t.shape)} {t.dtype}" for k, t in self.tensors.items()]
        fields += [f"{k}: jagged {tuple(j.values.shape)} {j.values.dtype}" for k, j in self.jagged.items()]
        fields += [f"{k}: {a.dtype}" for k, a in self.non_tensors.items()]
        return f"Batch(n={len(self)}, {', '.join(fields)}, meta_info={sorted(self.meta_info)})"
