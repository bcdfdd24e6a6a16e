"""JaggedTensor's vectorised gather (a cumsum over segment jumps) equals slicing every sample by hand,
including empty samples, repeated and reordered indices, and trailing feature dims."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mrl.data.jagged import JaggedTensor


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=20),
    data=st.data(),
    feature=st.sampled_from([(), (3,), (2, 2)]),
)
def test_index_select_equals_concatenated_hand_slices(lengths, data, feature):
    samples = [torch.randn(length, *feature) for length in lengths]
    jagged = JaggedTensor.from_list(samples)
    index = data.draw(st.lists(st.integers(0, len(lengths) - 1), max_size=30))
    picked = jagged.index_select(torch.tensor(index, dtype=torch.int64))
    assert picked.lengths().tolist() == [lengths[i] for i in index]
    assert picked.values.shape[1:] == feature
    assert torch.equal(picked.values, torch.cat([samples[i] for i in index]) if index else picked.values[:0])
    assert all(torch.equal(picked[k], samples[i]) for k, i in enumerate(index))


def test_padded_conversions_respect_lengths_and_max_length():
    jagged = JaggedTensor.from_list([torch.tensor([1, 2, 3]), torch.tensor([], dtype=torch.int64), torch.tensor([4])])
    padded, lengths = jagged.to_padded(pad_value=-1, max_length=5)
    assert padded.tolist() == [[1, 2, 3, -1, -1], [-1] * 5, [4, -1, -1, -1, -1]]
    assert lengths.tolist() == [3, 0, 1]
    assert JaggedTensor.from_padded(padded, lengths).equal(jagged)
    with pytest.raises(ValueError, match="max_length 2 is shorter than the longest sample \\(3\\)"):
        jagged.to_padded(max_length=2)
    with pytest.raises(ValueError, match="do not fit a padded tensor of shape \\(3, 5\\)"):
        JaggedTensor.from_padded(padded, [6, 0, 1])


def test_empty_and_scalar_inputs():
    empty = JaggedTensor.from_list([], like=torch.zeros(0, 4, dtype=torch.float16))
    assert len(empty) == 0 and empty.values.shape == (0, 4) and empty.values.dtype == torch.float16
    assert empty.to_padded()[0].shape == (0, 0, 4)
    with pytest.raises(ValueError, match="0-d tensor"):
        JaggedTensor.from_list([torch.tensor(1.0)])
    with pytest.raises(ValueError, match="1-D int64"):
        JaggedTensor(torch.zeros(3), torch.tensor([0, 3], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16, torch.bool])
def test_pickle_round_trips_and_names_no_megatron_module(dtype):
    import pickle

    import megatron.core  # noqa: F401  (replaces torch's storage loader, which a tensor's pickle names)

    samples = [torch.randn(n, 2, 2).to(dtype) for n in (3, 0, 5)]
    whole = JaggedTensor.from_list(samples)
    for jagged in (whole, whole.slice(1, 3), JaggedTensor.from_list([], like=samples[0])):
        before = jagged.values.clone()
        data = pickle.dumps(jagged, protocol=5)
        assert b"megatron" not in data
        back = pickle.loads(data)
        assert back.equal(jagged) and back.values.shape == jagged.values.shape
        back.values.zero_()  # writable, and its own memory: the original is untouched
        assert torch.equal(jagged.values, before)
