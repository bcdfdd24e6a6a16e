"""Mapping primitives: every TP rank's slice, merged back and converted to HF names, is the original exactly.

Also pins Megatron's fused-QKV row order (per query group: its query heads, then its key, then its value) and
the gated-MLP order ([gate; up] on every rank) against layouts built independently here.
"""

from __future__ import annotations

import pytest
import torch

from bridges.mapping import QKV, ColumnParallel, GateUp, ModelShape, Replicated, RowParallel, Shard, Tied


class InMemory:
    """A LazyTensor over an in-memory tensor that records which elements were read."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.shape = tuple(tensor.shape)
        self.read = 0

    def __getitem__(self, index):
        out = self.tensor[index].clone()
        self.read += out.numel()
        return out


def _shards(mapping, hf: list[torch.Tensor], tp: int, shape: ModelShape) -> tuple[list[torch.Tensor], list[InMemory]]:
    readers = [[InMemory(t) for t in hf] for _ in range(tp)]
    return [mapping.load(readers[r], Shard(r, tp), shape) for r in range(tp)], [x for rs in readers for x in rs]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("heads", "groups"), [(8, 8), (8, 4), (8, 2), (4, 4), (4, 1)])
def test_fused_qkv_is_group_interleaved_and_round_trips(tp, bias, heads, groups):
    """Fewer groups than TP ranks (8/2 at TP=4, 4/1 at TP=2 and 4): rank r holds row block r of the full tensor."""
    d, hidden = 4, 16
    shape = ModelShape(heads, groups, d)
    g = torch.Generator().manual_seed(heads * 10 + groups)
    rest = () if bias else (hidden,)
    q, k, v = (torch.randn(n * d, *rest, generator=g) for n in (heads, groups, groups))
    mapping = QKV("a.*.qkv", "q.*", "k.*", "v.*")
    shards, readers = _shards(mapping, [q, k, v], tp, shape)
    full = mapping.merge(shards, shape)
    per_group = heads // groups
    expected = torch.cat(
        [
            torch.cat(
                [q[(i * per_group) * d : (i + 1) * per_group * d], k[i * d : (i + 1) * d], v[i * d : (i + 1) * d]]
            )
            for i in range(groups)
        ]
    )
    assert torch.equal(full, expected)
    assert all(torch.equal(a, b) for a, b in zip(mapping.to_hf(full, shape), (q, k, v)))
    # the one-copy sender's row blocks: views of `full` (nothing copied) whose flatten(0, 1) is each HF tensor
    blocks = mapping.to_hf_blocks(full, shape)
    assert [b.shape[:2] for b in blocks] == [(groups, per_group * d), (groups, d), (groups, d)]
    assert all(b.untyped_storage().data_ptr() == full.untyped_storage().data_ptr() for b in blocks)
    assert all(torch.equal(a.flatten(0, 1), b) for a, b in zip(blocks, (q, k, v)))
    if groups >= tp:  # each rank read only its own heads: together exactly one copy of q, k and v
        assert sum(r.read for r in readers) == q.numel() + k.numel() + v.numel()
    else:  # megatron-core's layout: the full interleaved tensor in TP equal row blocks
        assert all(torch.equal(a, b) for a, b in zip(shards, expected.chunk(tp)))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gated_mlp_rank_holds_gate_then_up_and_round_trips(tp):
    g = torch.Generator().manual_seed(tp)
    gate, up = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
    mapping = GateUp("fc1.*", "gate.*", "up.*")
    shape = ModelShape(1, 1, 1)
    shards, _ = _shards(mapping, [gate, up], tp, shape)
    rows = 16 // tp
    for r, shard in enumerate(shards):
        assert torch.equal(shard, torch.cat([gate[r * rows : (r + 1) * rows], up[r * rows : (r + 1) * rows]]))
    full = mapping.merge(shards, shape)
    assert torch.equal(full, torch.cat([gate, up]))
    assert all(torch.equal(a, b) for a, b in zip(mapping.to_hf(full, shape), (gate, up)))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(("factory", "dim"), [(ColumnParallel, 0), (RowParallel, 1), (Replicated, None)])
def test_column_row_replicated_split_where_megatron_splits(tp, factory, dim):
    weight = torch.randn(8, 12, generator=torch.Generator().manual_seed(3))
    mapping = factory("m.*.w", "h.*.w")
    shape = ModelShape(1, 1, 1)
    shards, _ = _shards(mapping, [weight], tp, shape)
    expected = [weight] * tp if dim is None else list(weight.chunk(tp, dim=dim))
    assert all(torch.equal(a, b) for a, b in zip(shards, expected))
    assert torch.equal(mapping.to_hf(mapping.merge(shards, shape), shape)[0], weight)


def test_wildcards_resolve_layer_then_expert_on_both_sides():
    mapping = GateUp("decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight", "l.*.e.*.gate", "l.*.e.*.up")
    assert mapping.match("decoder.layers.3.mlp.experts.local_experts.11.linear_fc1.weight") == (3, 11)
    assert mapping.match("decoder.layers.3.mlp.linear_fc1.weight") is None
    assert mapping.hf_names((3, 11)) == ["l.3.e.11.gate", "l.3.e.11.up"]


def test_tied_output_is_imported_but_never_exported():
    mapping = Tied("output_layer.weight", "model.embed_tokens.weight")
    embedding = torch.randn(8, 4)
    assert torch.equal(mapping.load([InMemory(embedding)], Shard(1, 2), ModelShape(1, 1, 1)), embedding[4:])
    assert mapping.export_names(()) == []


def test_mismatched_wildcards_are_rejected_at_declaration():
    with pytest.raises(ValueError, match="wildcards"):
        ColumnParallel("decoder.layers.*.x", "model.x")


def test_indivisible_split_names_the_parameter():
    with pytest.raises(ValueError, match=r"m\.w"):
        ColumnParallel("m.w", "h.w").load([InMemory(torch.zeros(5, 2))], Shard(0, 2), ModelShape(1, 1, 1))
