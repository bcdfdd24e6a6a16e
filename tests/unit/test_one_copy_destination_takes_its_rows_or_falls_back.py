"""The one-copy loader's per-tensor choice (rollout_adapters/vllm/direct_load.py `Destination`): a destination takes
this engine rank's rows of a full HF tensor, or of a TP slice that holds them; a slice that does not hold them, or
a slice for a parameter that takes whole tensors, is left to the model's loaders (None); a tensor that comes as row
blocks [blocks, rows, *rest] (fused QKV's q/k/v from the one-copy sender) gives its rows as whole blocks, or None
where the rows span a cut block (rows within one block come as that block's rows)."""

import torch

from rollout_adapters.vllm.direct_load import Destination


def test_a_shard_destination_takes_its_rows_of_the_full_tensor():
    full = torch.arange(32.0).reshape(16, 2)
    dest = Destination("qkv", dim=0, start=4, length=8, src_start=8)  # rank 1 of 2: rows 8..16
    assert torch.equal(dest.source(full), full[8:16])
    param = torch.zeros(20, 2)
    dest.view(param).copy_(dest.source(full))
    assert torch.equal(param[4:12], full[8:16]) and not param[:4].any() and not param[12:].any()


def test_a_tp_slice_is_taken_only_where_it_holds_the_rows():
    full = torch.arange(32.0).reshape(16, 2)
    dest = Destination("qkv", dim=0, start=0, length=8, src_start=8)
    rank1 = full[8:16].clone()
    assert torch.equal(dest.source(rank1, [0, 1, 2]), full[8:16])  # the rank's own slice: all of it
    assert dest.source(full[:8].clone(), [0, 0, 2]) is None  # another rank's slice
    assert dest.source(full[:, 1:].clone(), [1, 1, 2]) is None  # sliced along another dim
    quarter = Destination("k", dim=0, start=0, length=4, src_start=12)  # a KV shard inside the slice
    assert torch.equal(quarter.source(rank1, [0, 1, 2]), full[12:16])


def test_a_whole_destination_takes_whole_tensors_only():
    t = torch.ones(3)
    whole = Destination("norm")
    assert whole.source(t) is t and whole.view(t) is t
    assert whole.source(t, [0, 0, 2]) is None


def test_a_vocabulary_destination_takes_only_the_unpadded_vocabulary():
    vocab = Destination("embed", dim=0, start=0, length=5, src_start=0, zero_rest=True)
    assert vocab.source(torch.ones(5, 2)).shape == (5, 2)
    assert vocab.source(torch.ones(8, 2)) is None  # padded rows from elsewhere: the loader decides


def test_row_blocks_give_whole_blocks_of_their_rows_or_fall_back():
    full = torch.arange(48.0).reshape(12, 4)
    blocks = full.view(4, 3, 4)  # 4 blocks of 3 rows
    dest = Destination("qkv", dim=0, start=0, length=6, src_start=6)  # rows 6..12: blocks 2 and 3
    assert torch.equal(dest.source(blocks, None, blocks=True), blocks[2:])
    assert torch.equal(dest.source(blocks, None, blocks=True).flatten(0, 1), dest.source(full))
    rank1 = blocks[2:].clone()  # TP rank 1's slice of 2, as blocks: rows 6..12 of the full tensor
    assert torch.equal(dest.source(rank1, [0, 1, 2], blocks=True), rank1)
    assert Destination("qkv", dim=0, start=0, length=4, src_start=6).source(blocks, None, blocks=True) is None
    assert Destination("qkv", dim=0, start=0, length=3, src_start=4).source(blocks, None, blocks=True) is None
    within = Destination("qkv", dim=0, start=0, length=2, src_start=4).source(blocks, None, blocks=True)
    assert within.shape == (1, 2, 4) and torch.equal(within.flatten(0, 1), full[4:6])
    assert Destination("w").source(blocks, None, blocks=True) is blocks  # whole parameter: all blocks
