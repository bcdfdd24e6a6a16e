"""Batch operations keep every sample intact: property tests over random jagged, fixed and non-tensor fields
compare each operation's samples against the plain Python rows the batch was built from."""

import pickle

import cloudpickle
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mrl.data.batch import Batch
from mrl.data.jagged import JaggedTensor

FIXED = ("pair",)
QUICK = settings(max_examples=30, deadline=None)


@st.composite
def samples(draw, min_n: int = 0, max_n: int = 10) -> list[dict]:
    """Rows with two jagged fields of independent lengths (one with a feature dim), a 0-d and a 2-vector fixed
    field, and non-tensor fields (a string and a dict)."""
    n = draw(st.integers(min_n, max_n))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    rows = []
    for i in range(n):
        prompt_and_response = draw(st.integers(0, 6))
        response = draw(st.integers(0, 5))
        rows.append(
            {
                "input_ids": torch.randint(0, 500, (prompt_and_response,), generator=generator),
                "position_ids": torch.randint(0, 9, (prompt_and_response, 3), generator=generator),
                "log_probs": torch.randn(response, generator=generator),
                "score": torch.randn((), generator=generator),
                "pair": torch.randn(2, generator=generator),
                "uid": f"uid-{draw(st.integers(0, 3))}",
                "tools_kwargs": {"row": i, "name": draw(st.sampled_from(["calc", "search"]))},
            }
        )
    return rows


def build(rows: list[dict]) -> Batch:
    return Batch.from_lists(rows, meta_info={"global_steps": 7}, fixed_keys=FIXED)


def assert_rows(batch: Batch, expected: list[dict]) -> None:
    assert len(batch) == len(expected)
    for i, row in enumerate(expected):
        got = batch[i]
        assert got.keys() == row.keys()
        for key, value in row.items():
            if isinstance(value, torch.Tensor):
                assert got[key].dtype == value.dtype, key
                assert torch.equal(got[key], value), (i, key)
            else:
                assert got[key] == value, (i, key)


def test_field_kinds_follow_the_declared_rule_not_the_data():
    # Equal lengths everywhere must still give jagged fields: a kind that flips with the data breaks concat.
    rows = [{"ids": torch.arange(3), "pair": torch.zeros(2), "score": 1.5, "uid": "a"} for _ in range(4)]
    batch = Batch.from_lists(rows, fixed_keys=["pair"])
    assert set(batch.jagged) == {"ids"}
    assert set(batch.tensors.keys()) == {"pair", "score"}
    assert set(batch.non_tensors) == {"uid"}
    assert batch["score"].dtype == torch.float32 and batch["pair"].shape == (4, 2)


@QUICK
@given(rows=samples(), divisor=st.integers(1, 4))
def test_pad_chunk_concat_unpad_is_identity(rows, divisor):
    batch = build(rows)
    padded, pad_count = batch.pad_to_divisible(divisor)
    assert len(padded) % divisor == 0 and 0 <= pad_count < divisor
    # Padding rows are copies of real rows (cycling from the front), so read-only calls on them are harmless.
    expected = rows + [rows[i % len(rows)] for i in range(pad_count)]
    assert_rows(padded, expected)
    parts = padded.chunk(divisor)
    size = len(padded) // divisor
    for k, part in enumerate(parts):
        assert part.meta_info == {"global_steps": 7}
        assert_rows(part, expected[k * size : (k + 1) * size])
    restored = Batch.concat(parts).unpad(pad_count)
    assert_rows(restored, rows)
    assert restored.equal(batch)


@QUICK
@given(rows=samples(), repeats=st.integers(1, 3))
def test_repeat_interleaved_keeps_copies_adjacent_and_tiled_repeats_the_whole_batch(rows, repeats):
    batch = build(rows)
    assert_rows(batch.repeat(repeats, interleave=True), [row for row in rows for _ in range(repeats)])
    assert_rows(batch.repeat(repeats, interleave=False), rows * repeats)


@QUICK
@given(rows=samples(), data=st.data())
def test_selection_by_index_list_mask_and_slice_matches_the_rows(rows, data):
    batch = build(rows)
    n = len(rows)
    index = data.draw(st.lists(st.integers(-n, n - 1), max_size=12)) if n else []
    assert_rows(batch[index], [rows[i] for i in index])
    assert_rows(batch[torch.tensor(index, dtype=torch.int64)], [rows[i] for i in index])
    mask = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    assert_rows(batch[torch.tensor(mask, dtype=torch.bool)], [r for r, keep in zip(rows, mask) if keep])
    start, stop, step = (
        data.draw(st.integers(-12, 12)),
        data.draw(st.integers(-12, 12)),
        data.draw(st.integers(-3, 3).filter(bool)),
    )
    assert_rows(batch[start:stop:step], rows[start:stop:step])


@QUICK
@given(rows=samples())
def test_pickle_and_cloudpickle_round_trips_preserve_every_field(rows):
    batch = build(rows)
    for part in batch.chunk(2) if len(batch) % 2 == 0 else [batch]:
        for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):
            again = loads(dumps(part))
            assert again.equal(part)
            assert again.meta_info == part.meta_info


@QUICK
@given(rows=samples(min_n=1))
def test_padded_view_and_list_view_of_a_jagged_field_agree_with_the_rows(rows):
    batch = build(rows)
    padded, lengths = batch.as_padded("position_ids", pad_value=-1)
    assert lengths.tolist() == [len(r["position_ids"]) for r in rows]
    for i, row in enumerate(rows):
        assert torch.equal(padded[i, : lengths[i]], row["position_ids"])
        assert (padded[i, lengths[i] :] == -1).all()
    assert JaggedTensor.from_padded(padded, lengths).equal(batch["position_ids"])
    listed = batch.as_list("log_probs")
    assert len(listed) == len(rows) and all(torch.equal(a, r["log_probs"]) for a, r in zip(listed, rows))
    assert batch.as_list("uid") == [r["uid"] for r in rows]


def test_contiguous_chunks_are_views_and_other_selections_copy():
    batch = build(
        [
            {
                "input_ids": torch.arange(4),
                "position_ids": torch.zeros(4, 3),
                "log_probs": torch.zeros(2),
                "score": torch.tensor(0.0),
                "pair": torch.zeros(2),
                "uid": "a",
                "tools_kwargs": {},
            }
        ]
        * 4
    )
    first, _ = batch.chunk(2)
    assert first["input_ids"].values.data_ptr() == batch["input_ids"].values.data_ptr()
    assert first["pair"].data_ptr() == batch["pair"].data_ptr()
    picked = batch[[0, 1]]
    assert picked["input_ids"].values.data_ptr() != batch["input_ids"].values.data_ptr()


def test_to_device_keeps_samples_and_meta():
    batch = build(
        [
            {
                "input_ids": torch.arange(i),
                "position_ids": torch.zeros(i, 3),
                "log_probs": torch.ones(i),
                "score": torch.tensor(float(i)),
                "pair": torch.zeros(2),
                "uid": str(i),
                "tools_kwargs": {},
            }
            for i in range(3)
        ]
    )
    moved = batch.to("cpu")
    assert moved.equal(batch)
    assert moved["input_ids"].offsets.device.type == "cpu"
