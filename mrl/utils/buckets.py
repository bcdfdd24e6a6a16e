"""Greedy byte-bounded grouping of a (name, tensor) stream: weight-sync buckets, safetensors shards."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def group_by_bytes(
    named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of whole tensors, each at most `max_bytes` unless a single tensor is larger.

    Lazy: a group is yielded as soon as the next tensor would overflow it, so a consumer holds one group at a time.
    """
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > max_bytes:
            yield group
            group, size = [], 0
        group.append((name, tensor))
        size += nbytes
    if group:
        yield group
