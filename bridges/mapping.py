"""Mapping primitives: one Megatron parameter pattern ⇄ one or more HF tensor names, and how to (re)shard.

Patterns use `*` for an index: the first `*` of a pattern is the layer, the second (inside experts) the
global expert id, in both namings. Megatron names are canonical global names (see `bridges.names`): layer
indices count from the first layer of the whole model, expert indices from the first expert of the layer.

A primitive answers three questions:
- `load(read, shard)`: this rank's slice of the Megatron tensor, reading only the HF slices it needs
  (`read(name)` returns a lazy HF tensor; indexing it reads just that slice from disk);
- `merge(shards)`: the unsharded Megatron tensor from the TP (or expert-TP) shards in rank order;
- `to_hf(full)`: the HF tensors (name order as declared) of an unsharded Megatron tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class LazyTensor(Protocol):
    """An HF tensor on disk: `shape`, and `[...]` indexing that reads only the requested slice."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


Reader = Callable[[str], LazyTensor]


@dataclass(frozen=True)
class Shard:
    """Position of this rank in the group that splits the tensor (TP for dense, expert-TP for experts)."""

    rank: int = 0
    size: int = 1

    def span(self, length: int, what: str) -> slice:
        if length % self.size:
            raise ValueError(f"{what}: size {length} is not divisible by the parallel size {self.size}")
        step = length // self.size
        return slice(self.rank * step, (self.rank + 1) * step)


@dataclass(frozen=True)
class ModelShape:
    """The attention geometry that fused QKV needs (taken from the TransformerConfig), and the vocabulary: the
    HF one and the model's rows (padded to a multiple of TP; 0: not padded)."""

    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab: int = 0
    padded_vocab: int = 0


def padded_vocab_size(vocab: int, tp: int, divisor: int = 1) -> int:
    """Megatron's `make_vocab_size_divisible_by`: the vocabulary rounded up to a multiple of divisor × TP, so
    that every TP rank holds as many embedding and output rows."""
    step = divisor * tp
    return -(-vocab // step) * step


def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"(\d+)") + "$")


def _fill(pattern: str, indices: Sequence[int]) -> str:
    parts = pattern.split("*")
    if len(parts) - 1 != len(indices):
        raise ValueError(f"pattern {pattern!r} has {len(parts) - 1} wildcards, got indices {indices}")
    out = parts[0]
    for index, part in zip(indices, parts[1:]):
        out += str(index) + part
    return out


@dataclass(frozen=True)
class Mapping:
    """Base primitive: a Megatron pattern and its HF patterns (same wildcards, same order)."""

    megatron: str
    hf: tuple[str, ...]
    tp_dim: int | None = None  # the dimension split over TP; None = replicated
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regex", _compile(self.megatron))
        wildcards = self.megatron.count("*")
        for name in self.hf:
            if name.count("*") != wildcards:
                raise ValueError(f"{type(self).__name__}: {name!r} and {self.megatron!r} differ in wildcards")

    def match(self, megatron_name: str) -> tuple[int, ...] | None:
        found = self._regex.match(megatron_name)
        return None if found is None else tuple(int(g) for g in found.groups())

    def hf_names(self, indices: Sequence[int]) -> list[str]:
        return [_fill(name, indices) for name in self.hf]

    def export_names(self, indices: Sequence[int]) -> list[str]:
        """HF names that `to_hf` produces (empty for import-only mappings such as a tied output layer)."""
        return self.hf_names(indices)

    def load(self, read: list[LazyTensor], shard: Shard, shape: ModelShape) -> torch.Tensor:
        (tensor,) = read
        if self.tp_dim is None or shard.size == 1:
            return tensor[...]
        index: list[slice] = [slice(None)] * len(tensor.shape)
        index[self.tp_dim] = shard.span(tensor.shape[self.tp_dim], self.megatron)
        return tensor[tuple(index)]

    def merge(self, shards: Sequence[torch.Tensor], shape: ModelShape) -> torch.Tensor:
        if self.tp_dim is None or len(shards) == 1:
            return shards[0]
        return torch.cat(list(shards), dim=self.tp_dim)

    def to_hf(self, full: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
        return [full]


def Replicated(megatron: str, hf: str) -> Mapping:
    """The same tensor on every TP rank (norms, routers, expert biases, TP-replicated biases)."""
    return Mapping(megatron, (hf,), tp_dim=None)


def ColumnParallel(megatron: str, hf: str) -> Mapping:
    """Split along the output dimension (rows): column-parallel weights and biases, vocab-parallel embeddings."""
    return Mapping(megatron, (hf,), tp_dim=0)


def RowParallel(megatron: str, hf: str) -> Mapping:
    """Split along the input dimension (columns): attention output and MLP down projections."""
    return Mapping(megatron, (hf,), tp_dim=1)


@dataclass(frozen=True)
class VocabParallel(Mapping):
    """The embedding and the output layer: rows split over TP like ColumnParallel, the vocabulary padded with
    zero rows to the model's (padded) size on import and cut back to the HF size on export, so padded rows never
    leave the trainer."""

    tp_dim: int | None = 0

    def load(self, read: list[LazyTensor], shard: Shard, shape: ModelShape) -> torch.Tensor:
        (tensor,) = read
        padded = max(shape.padded_vocab, tensor.shape[0])
        rows = shard.span(padded, self.megatron)
        real = tensor[rows.start : min(rows.stop, tensor.shape[0])]
        if real.shape[0] == rows.stop - rows.start:
            return real
        pad = real.new_zeros(rows.stop - rows.start - real.shape[0], *real.shape[1:])
        return torch.cat([real, pad])

    def to_hf(self, full: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
        return [full[: shape.vocab] if shape.vocab and full.shape[0] > shape.vocab else full]


@dataclass(frozen=True)
class TiedOutput(VocabParallel):
    """The output layer of a model with tied embeddings: filled from the embedding on import (on the last
    pipeline stage it is its own parameter), never exported (HF stores only the embedding)."""

    def export_names(self, indices: Sequence[int]) -> list[str]:
        return []


@dataclass(frozen=True)
class GatedMLP(Mapping):
    """Megatron's fc1 = [gate; up] per TP rank ⇄ HF gate_proj and up_proj (dense, shared and routed experts).

    Rank r holds [gate_r; up_r], so the unsharded tensor is [gate; up] re-assembled from the halves of every
    shard, not the plain concatenation of shards.
    """

    tp_dim: int | None = 0

    def load(self, read: list[LazyTensor], shard: Shard, shape: ModelShape) -> torch.Tensor:
        gate, up = read
        rows = shard.span(gate.shape[0], self.megatron)
        return torch.cat([gate[rows], up[rows]], dim=0)

    def merge(self, shards: Sequence[torch.Tensor], shape: ModelShape) -> torch.Tensor:
        if len(shards) == 1:  # [gate; up] already: no copy (half the model's bytes at TP=1)
            return shards[0]
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)

    def to_hf(self, full: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
        return list(full.chunk(2, dim=0))


@dataclass(frozen=True)
class FusedQKV(Mapping):
    """Megatron's linear_qkv (weight or bias) ⇄ HF q/k/v projections, GQA-aware.

    Megatron orders rows by query group: for each group g, its heads_per_group query heads, then its key head,
    then its value head (each head_dim rows). TP splits whole groups, so rank r reads the contiguous query heads
    and KV heads of its groups and interleaves them locally; the concatenation of shards is the full tensor.
    With fewer groups than TP ranks, megatron-core (0.19 `get_query_key_value_tensors`) splits the full
    interleaved tensor into TP equal row blocks and all-gathers it in every forward: rank r holds block r.
    """

    tp_dim: int | None = 0

    def load(self, read: list[LazyTensor], shard: Shard, shape: ModelShape) -> torch.Tensor:
        q, k, v = read
        if shape.num_query_groups < shard.size:
            whole = self.load(read, Shard(0, 1), shape)
            return whole[shard.span(whole.shape[0], self.megatron)]
        groups = shard.span(shape.num_query_groups, self.megatron)
        heads = shard.span(shape.num_heads, self.megatron)
        d = shape.head_dim
        q_t = q[heads.start * d : heads.stop * d]
        k_t = k[groups.start * d : groups.stop * d]
        v_t = v[groups.start * d : groups.stop * d]
        n_groups = groups.stop - groups.start
        rest = q_t.shape[1:]
        per_group = [t.reshape(n_groups, -1, *rest) for t in (q_t, k_t, v_t)]
        return torch.cat(per_group, dim=1).reshape(-1, *rest)

    def to_hf(self, full: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
        return [t.flatten(0, 1) for t in self.to_hf_blocks(full, shape)]

    def to_hf_blocks(self, full: torch.Tensor, shape: ModelShape) -> list[torch.Tensor]:
        """q, k, v as views [groups, rows per group, *rest] of `full`: each one's flatten(0, 1) is the HF tensor
        (a copy unless there is one group), so a consumer that places rows itself can skip that copy."""
        g, d = shape.num_query_groups, shape.head_dim
        per_group = shape.num_heads // g
        return list(full.unflatten(0, (g, (per_group + 2) * d)).split([per_group * d, d, d], dim=1))


def QKV(megatron: str, q: str, k: str, v: str) -> Mapping:
    return FusedQKV(megatron, (q, k, v))


def GateUp(megatron: str, gate: str, up: str) -> Mapping:
    return GatedMLP(megatron, (gate, up))


def Vocab(megatron: str, hf: str) -> Mapping:
    return VocabParallel(megatron, (hf,))


def Tied(megatron: str, hf: str) -> Mapping:
    return TiedOutput(megatron, (hf,))
