"""THD packing: jagged samples → micro-batches of one packed row each, and per-token results back.

A micro-batch concatenates whole samples into one row [1, T] (T = Σ lengths, rounded up to `pad_to_multiple` with
a trailing pad segment), described by `cu_seqlens` so attention and RoPE restart at every sample. Samples are
never split, which keeps per-sequence loss terms local to one micro-batch (mrl/algo/aggregation.py).

Next-token alignment: with labels[p] = row[p+1], the logits at p score token p+1, so the log-prob of token t of a
sample sits at packed position t−1 of that sample. `shift_to_tokens` moves per-position results one step right
and zeroes each sample's first position (nothing predicts it), giving token-aligned outputs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class JaggedBatch:
    """Samples of different lengths without padding: sample i owns rows offsets[i]:offsets[i+1] of every token
    field ([N, ...], `input_ids` required); sample fields are [B, ...]."""

    offsets: Tensor
    token_fields: dict[str, Tensor]
    sample_fields: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "input_ids" not in self.token_fields:
            raise ValueError("a JaggedBatch needs token field 'input_ids'")
        n = int(self.offsets[-1])
        bad = {k: v.shape[0] for k, v in self.token_fields.items() if v.shape[0] != n}
        if bad:
            raise ValueError(f"token fields must have offsets[-1] = {n} rows, got {bad}")

    @classmethod
    def from_sequences(cls, sequences: Sequence[Mapping[str, Tensor]], **sample_fields: Tensor) -> JaggedBatch:
        """Concatenate per-sample dicts of 1-D token tensors (all with the same keys)."""
        lengths = torch.tensor([len(s["input_ids"]) for s in sequences])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        keys = sequences[0].keys()
        fields = {k: torch.cat([s[k] for s in sequences]) for k in keys}
        return cls(offsets, fields, dict(sample_fields))

    @classmethod
    def from_batch(cls, batch: Any) -> JaggedBatch:
        """View of an `mrl.data.batch.Batch`: its jagged fields become token fields (they must share the offsets
        of `input_ids`, i.e. be aligned with whole sequences), its fixed-shape tensors sample fields."""
        ids = batch.jagged_field("input_ids")
        misaligned = [k for k, j in batch.jagged.items() if not torch.equal(j.offsets, ids.offsets)]
        if misaligned:
            raise ValueError(f"jagged fields {misaligned} are not aligned with input_ids (different offsets)")
        return cls(
            ids.offsets,
            {k: j.values for k, j in batch.jagged.items()},
            dict(batch.tensors.items()),
        )

    @property
    def lengths(self) -> Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def select(self, index: Sequence[int]) -> JaggedBatch:
        """The samples at `index`, in that order."""
        starts, ends = self.offsets[:-1].tolist(), self.offsets[1:].tolist()
        rows = (
            torch.cat([torch.arange(starts[i], ends[i]) for i in index]) if index else torch.zeros(0, dtype=torch.long)
        )
        lengths = self.lengths[list(index)]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        return JaggedBatch(
            offsets,
            {k: v[rows] for k, v in self.token_fields.items()},
            {k: v[list(index)] for k, v in self.sample_fields.items()},
        )


def split_by_count(lengths: Sequence[int], micro_batch_size: int, multiple_of: int = 1) -> list[list[int]]:
    """Consecutive groups of at most `micro_batch_size` samples; their number is rounded up to a multiple of
    `multiple_of` (the interleaved pipeline schedule runs micro-batches in groups of PP), sizes kept even."""
    n = len(lengths)
    needed = math.ceil(n / micro_batch_size)
    if needed % multiple_of == 0:
        return [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]
    groups = math.ceil(needed / multiple_of) * multiple_of
    if groups > n:
        raise ValueError(f"cannot form {groups} micro-batches (a multiple of {multiple_of}) from {n} samples")
    bounds = [round(i * n / groups) for i in range(groups + 1)]
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds)]


def split_by_tokens(lengths: Sequence[int], max_tokens: int, min_micro_batches: int = 1) -> list[list[int]]:
    """Dynamic batch size: as few micro-batches as possible holding ≤ max_tokens tokens each.

    First-fit over samples in decreasing length (so long samples do not strand space), then each micro-batch's
    samples are kept in their original order. `min_micro_batches` forces at least that many non-empty groups
    (a pipeline schedule needs enough micro-batches to fill its stages). A sample longer than the budget is an
    error: packing never splits a sample.
    """
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        raise ValueError(f"samples {too_long[:4]} (index, length) exceed the token budget max_tokens={max_tokens}")
    if min_micro_batches > len(lengths):
        raise ValueError(f"cannot form {min_micro_batches} micro-batches from {len(lengths)} samples")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = [[] for _ in range(min_micro_batches)]
    loads = [0] * min_micro_batches
    for i in order:
        # Prefer the emptiest bin among those with room: balances the forced bins, fills greedily otherwise.
        fits = [b for b in range(len(bins)) if loads[b] + lengths[i] <= max_tokens]
        if fits:
            b = min(fits, key=lambda b: (loads[b], b))
        else:
            bins.append([])
            loads.append(0)
            b = len(bins) - 1
        bins[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in bins]


@dataclass
class PackedMicroBatch:
    """One packed row and the bookkeeping to map results back to its samples."""

    input_ids: Tensor  # [1, T] (T includes the trailing pad segment)
    position_ids: Tensor  # [1, T], restarting at 0 in every sample
    cu_seqlens: Tensor  # int32 [n_segments + 1]; the pad segment, if any, is the last one
    max_seqlen: int
    sample_index: list[int]  # positions of these samples in the step's batch
    lengths: list[int]  # real lengths of the n samples
    fields: dict[str, Tensor]  # padded [n, max_len] per-token fields and [n, ...] sample fields
    token_mask: Tensor  # [n, max_len] bool: True where a sample has a token

    @property
    def num_tokens(self) -> int:
        return int(sum(self.lengths))

    def packed_seq_params(self, *, host_rope_offsets: bool = False):
        """Megatron's THD description of the row. `host_rope_offsets` also hands the offsets, as a CPU tensor, in
        the `*_padded` fields, which Megatron's unfused THD RoPE alone reads when TransformerEngine is absent:
        it splits the row with `.tolist()`/`.item()` on them twice per layer, host synchronisations on a device
        tensor (nothing else without TE reads them; with TE they mean context-parallel padding: leave them)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        host = None
        if host_rope_offsets:
            pad = self.input_ids.shape[1] - self.num_tokens
            host = torch.tensor([0, *itertools.accumulate([*self.lengths, *([pad] if pad else [])])], dtype=torch.int32)
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=host,
            cu_seqlens_kv_padded=host,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )

    def unpack(self, per_position: Tensor) -> Tensor:
        """[T, ...] packed values → [n, max_len, ...] padded by sample (0 where a sample has no token)."""
        index = _padded_index(self.lengths, per_position.device)
        out = per_position[index.clamp_min(0)]
        mask = (index >= 0).view(*index.shape, *([1] * (per_position.dim() - 1)))
        return torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))

    def to(self, device: torch.device | str) -> PackedMicroBatch:
        return PackedMicroBatch(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.cu_seqlens.to(device),
            self.max_seqlen,
            self.sample_index,
            self.lengths,
            {k: v.to(device) for k, v in self.fields.items()},
            self.token_mask.to(device),
        )


def _padded_index(lengths: Sequence[int], device: torch.device | None = None) -> Tensor:
    """[n, max_len] packed position of token t of sample i, −1 past the sample's end."""
    lens = torch.tensor(list(lengths), device=device)
    starts = torch.cumsum(lens, 0) - lens
    t = torch.arange(int(lens.max()) if len(lengths) else 0, device=device)
    index = starts[:, None] + t[None, :]
    return torch.where(t[None, :] < lens[:, None], index, torch.full_like(index, -1))


def pack(
    batch: JaggedBatch,
    index: Sequence[int],
    pad_to_multiple: int = 1,
    pad_token_id: int = 0,
    length: int | None = None,
) -> PackedMicroBatch:
    """Pack samples `index` of `batch` into one row; pad the row to a multiple of `pad_to_multiple` (sequence
    parallelism splits the row over TP ranks), or to exactly `length` (pipeline stages exchange fixed-shape
    activations), with one extra segment of `pad_token_id`."""
    sub = batch.select(index)
    lengths = sub.lengths.tolist()
    total = int(sum(lengths))
    padded = -(-total // pad_to_multiple) * pad_to_multiple
    if length is not None:
        if length < padded or length % pad_to_multiple:
            raise ValueError(f"cannot pad {total} tokens to length {length} (multiple of {pad_to_multiple})")
        padded = length
    ids = sub.token_fields["input_ids"]
    segments = list(lengths)
    if padded > total:
        ids = torch.cat([ids, ids.new_full((padded - total,), pad_token_id)])
        segments.append(padded - total)
    seg = torch.tensor(segments, dtype=torch.int32)
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int32), seg.cumsum(0, dtype=torch.int32)])
    position_ids = torch.cat([torch.arange(n) for n in segments])
    index_mat = _padded_index(lengths)
    token_mask = index_mat >= 0
    fields: dict[str, Tensor] = {}
    for k, v in sub.token_fields.items():
        gathered = v[index_mat.clamp_min(0)]
        mask = token_mask.view(*token_mask.shape, *([1] * (v.dim() - 1)))
        fields[k] = torch.where(mask, gathered, torch.zeros((), dtype=v.dtype))
    fields.update(sub.sample_fields)
    return PackedMicroBatch(
        input_ids=ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=max(segments),
        sample_index=list(index),
        lengths=lengths,
        fields=fields,
        token_mask=token_mask,
    )


def next_token_labels(input_ids: Tensor) -> Tensor:
    """labels[p] = input_ids[p+1] along the last dim (the final position wraps; its result is discarded by
    `shift_to_tokens` because it is the last position of the last segment)."""
    return torch.roll(input_ids, shifts=-1, dims=-1)


def shift_to_tokens(per_position: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Token-aligned view of results scored at the previous position: out[t] = x[t−1], out[segment start] = 0."""
    out = torch.roll(per_position, shifts=1, dims=0)
    starts = cu_seqlens[:-1].long().to(per_position.device)
    keep = torch.ones(per_position.shape[0], dtype=torch.bool, device=per_position.device)
    keep[starts[starts < per_position.shape[0]]] = False
    keep = keep.view(-1, *([1] * (per_position.dim() - 1)))
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


def scatter_to_batch(per_sample: Sequence[tuple[list[int], Tensor]], lengths: Sequence[int]) -> Tensor:
    """Reassemble padded [n, max_len] results of micro-batches into the batch's flat [N] layout (sample order)."""
    parts: list[Tensor | None] = [None] * len(lengths)
    for index, padded in per_sample:
        for row, i in enumerate(index):
            parts[i] = padded[row, : lengths[i]]
    missing = [i for i, p in enumerate(parts) if p is None]
    if missing:
        raise ValueError(f"samples {missing[:8]} have no result")
    return torch.cat(parts)  # type: ignore[arg-type]
