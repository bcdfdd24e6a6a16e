"""Duck-typed data operations used by dispatch: length, split, concat, pad, unpad.

"Data" is a plain list, a torch tensor (rows along dim 0), or a batch-like object with `chunk(n) -> list`,
`concat(list)` (classmethod or staticmethod), `pad_to_divisible(n) -> (padded, pad_count)`, `unpad(pad_count)`
and `__len__` (the interface of mrl.data.Batch, which is not imported here). Anything else is not data and is
passed unchanged to every rank.

torch is never imported here: a tensor can only reach us if torch is already loaded, so workers that move
plain Python data stay free of its import cost.
"""

from __future__ import annotations

import sys
from typing import Any

BATCH_METHODS = ("chunk", "concat", "pad_to_divisible", "unpad", "__len__")


def _is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_batch(x: Any) -> bool:
    return all(callable(getattr(x, m, None)) for m in BATCH_METHODS)


def is_data(x: Any) -> bool:
    return isinstance(x, list) or _is_tensor(x) or _is_batch(x)


def data_len(x: Any) -> int:
    if _is_tensor(x):
        if x.dim() == 0:
            raise ValueError("a 0-dim tensor has no rows to split")
        return x.shape[0]
    return len(x)


def split(x: Any, n: int) -> list[Any]:
    """Cut x into n equal contiguous parts; len(x) must be divisible by n (pad first where allowed)."""
    length = data_len(x)
    if length % n:
        raise ValueError(f"cannot split {length} rows into {n} equal parts")
    if _is_batch(x):
        parts = list(x.chunk(n))
        if len(parts) != n:
            raise ValueError(f"{type(x).__name__}.chunk({n}) returned {len(parts)} parts")
        return parts
    k = length // n
    if _is_tensor(x):
        return [_compact(c) for c in x.split(k)] if k else [x[:0].clone()] * n
    return [x[i * k : (i + 1) * k] for i in range(n)]


def _compact(t: Any) -> Any:
    """A copy of t if it is a view into a larger storage: pickling a view (as Ray does to ship a chunk) writes
    the whole storage, so every rank would receive the full batch."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def concat(parts: list[Any]) -> Any:
    """Inverse of `split`: parts are joined in order; the type is taken from the first part."""
    if not parts:
        raise ValueError("nothing to concatenate")
    first = parts[0]
    if isinstance(first, list):
        return [item for p in parts for item in p]
    if _is_tensor(first):
        return sys.modules["torch"].cat(parts, dim=0)
    if _is_batch(first):
        return type(first).concat(parts)
    raise TypeError(f"cannot concatenate results of type {type(first).__name__}")


def pad_to_divisible(x: Any, n: int) -> tuple[Any, int]:
    """Append rows so that n divides the length; returns (padded, pad_count).

    Lists and tensors repeat their leading rows cyclically: padded rows are real inputs, so a read-only
    computation on them is well defined; they are stripped again by `unpad` on collect.
    """
    if _is_batch(x):
        return x.pad_to_divisible(n)
    length = data_len(x)
    pad = -length % n
    if pad == 0:
        return x, 0
    if length == 0:
        raise ValueError(f"cannot pad an empty batch to a multiple of {n}")
    if _is_tensor(x):
        torch = sys.modules["torch"]
        return torch.cat([x, x[torch.arange(pad) % length]], dim=0), pad
    return x + [x[i % length] for i in range(pad)], pad


def unpad(x: Any, pad_count: int) -> Any:
    if pad_count == 0:
        return x
    if _is_batch(x):
        return x.unpad(pad_count)
    if not (isinstance(x, list) or _is_tensor(x)):
        raise TypeError(f"cannot strip {pad_count} padded rows from a result of type {type(x).__name__}")
    return x[: data_len(x) - pad_count]


def can_concat(parts: list[Any]) -> bool:
    return bool(parts) and all(is_data(p) for p in parts) and len({type(p) for p in parts}) == 1
