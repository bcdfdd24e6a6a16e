"""THD packing: token budgets are respected without splitting samples, packed rows carry per-sample cu_seqlens
and restarting positions, unpack/scatter invert pack, and the next-token shift puts token t's result at t."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mrl.engine.megatron.packing import (
    JaggedBatch,
    next_token_labels,
    pack,
    scatter_to_batch,
    shift_to_tokens,
    split_by_count,
    split_by_tokens,
)


def make_batch(lengths):
    g = torch.Generator().manual_seed(sum(lengths))
    seqs = [
        {"input_ids": torch.randint(1, 100, (n,), generator=g), "mask": torch.rand(n, generator=g)} for n in lengths
    ]
    return JaggedBatch.from_sequences(seqs, score=torch.arange(len(lengths), dtype=torch.float32))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=12), st.integers(20, 50), st.integers(1, 3))
def test_token_budget_partition_is_exact_and_within_budget(lengths, budget, min_mb):
    if min_mb > len(lengths):
        min_mb = len(lengths)
    groups = split_by_tokens(lengths, budget, min_micro_batches=min_mb)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(lengths)))
    assert all(g for g in groups) and len(groups) >= min_mb
    assert all(sum(lengths[i] for i in g) <= budget for g in groups)
    # First-fit never needs more than twice the lower bound of bins.
    assert len(groups) <= max(min_mb, 2 * -(-sum(lengths) // budget))


def test_sample_over_budget_is_rejected():
    try:
        split_by_tokens([3, 30], 10)
    except ValueError as e:
        assert "exceed" in str(e)
    else:
        raise AssertionError("expected ValueError")


def test_count_split_keeps_order():
    assert split_by_count([1] * 5, 2) == [[0, 1], [2, 3], [4]]


def test_pack_layout_and_roundtrip():
    batch = make_batch([4, 1, 6])
    mb = pack(batch, [2, 0], pad_to_multiple=4)
    assert mb.cu_seqlens.tolist() == [0, 6, 10, 12]  # 10 real tokens + a pad segment of 2
    assert mb.input_ids.shape == (1, 12)
    assert mb.position_ids[0].tolist() == [*range(6), *range(4), 0, 1]
    ids = batch.token_fields["input_ids"]
    torch.testing.assert_close(mb.fields["input_ids"][0], ids[5:11])
    torch.testing.assert_close(mb.fields["input_ids"][1, :4], ids[0:4])
    assert mb.fields["input_ids"][1, 4:].eq(0).all()
    assert mb.fields["score"].tolist() == [2.0, 0.0]
    # unpack(packed row) reproduces the padded fields
    torch.testing.assert_close(mb.unpack(mb.input_ids[0]), mb.fields["input_ids"])
    # results of several micro-batches scatter back into the flat batch layout
    other = pack(batch, [1])
    flat = scatter_to_batch(
        [(mb.sample_index, mb.fields["mask"]), (other.sample_index, other.fields["mask"])], batch.lengths.tolist()
    )
    torch.testing.assert_close(flat, batch.token_fields["mask"])


def test_host_rope_offsets_equal_cu_seqlens_on_the_cpu():
    batch = make_batch([4, 1, 6])
    for mb in (pack(batch, [2, 0], pad_to_multiple=4), pack(batch, [0, 1, 2])):
        params = mb.packed_seq_params(host_rope_offsets=True)
        assert params.cu_seqlens_q_padded.device.type == "cpu"
        assert params.cu_seqlens_q_padded.dtype == torch.int32
        assert params.cu_seqlens_q_padded.tolist() == mb.cu_seqlens.tolist()
        assert params.cu_seqlens_kv_padded is params.cu_seqlens_q_padded
    assert pack(batch, [0]).packed_seq_params().cu_seqlens_q_padded is None


def test_next_token_shift_aligns_log_prob_of_token_t_with_position_t_minus_1():
    batch = make_batch([3, 4])
    mb = pack(batch, [0, 1], pad_to_multiple=8)
    row = mb.input_ids[0]
    labels = next_token_labels(row)
    # "score" of position p = the label it predicts; after the shift, position t holds token t itself
    shifted = shift_to_tokens(labels.float(), mb.cu_seqlens)
    padded = mb.unpack(shifted)
    ids = mb.fields["input_ids"].float()
    valid = mb.token_mask.clone()
    valid[:, 0] = False
    assert torch.equal(padded[valid], ids[valid])
    assert padded[:, 0].eq(0).all()


def test_count_split_rounds_group_count_up_for_interleaved_pipelines():
    groups = split_by_count([1] * 5, 2, multiple_of=2)
    assert len(groups) == 4 and sorted(i for g in groups for i in g) == list(range(5))
    assert max(len(g) for g in groups) <= 2


def test_batch_jagged_fields_become_token_fields():
    from mrl.data.batch import Batch

    batch = make_batch([3, 5])
    ids, mask = batch.token_fields["input_ids"], batch.token_fields["mask"]
    b = Batch.from_dict(
        {"input_ids": [ids[:3], ids[3:]], "mask": [mask[:3], mask[3:]], "score": torch.tensor([1.0, 2.0])}
    )
    jb = JaggedBatch.from_batch(b)
    assert jb.offsets.tolist() == [0, 3, 8]
    torch.testing.assert_close(jb.token_fields["mask"], mask)
    assert jb.sample_fields["score"].tolist() == [1.0, 2.0]
    bad = Batch.from_dict({"input_ids": [ids[:3], ids[3:]], "mask": [mask[:2], mask[2:]]})
    try:
        JaggedBatch.from_batch(bad)
    except ValueError as e:
        assert "mask" in str(e)
    else:
        raise AssertionError("expected ValueError for misaligned jagged fields")
