"""select / union semantics, meta_info merging, and errors that name the sizes or keys at fault."""

import numpy as np
import pytest
import torch

from mrl.data.batch import Batch
from mrl.data.jagged import JaggedTensor


def make(n: int = 4, **meta) -> Batch:
    return Batch.from_dict(
        {
            "responses": [torch.arange(i + 1) for i in range(n)],
            "rewards": torch.arange(n, dtype=torch.float32),
            "uid": [f"u{i}" for i in range(n)],
        },
        meta_info=meta,
    )


def test_select_keeps_only_the_named_fields_and_shares_tensors():
    batch = make(step=1, temperature=1.0)
    picked = batch.select(["responses", "uid"], meta_info_keys=["step"])
    assert sorted(picked.keys()) == ["responses", "uid"] and picked.meta_info == {"step": 1}
    assert picked["responses"] is batch["responses"]
    assert sorted(batch.select().keys()) == sorted(batch.keys())
    with pytest.raises(KeyError, match=r"no fields \['advantages'\]"):
        batch.select(["advantages"])
    with pytest.raises(KeyError, match=r"no meta_info keys \['epoch'\]"):
        batch.select(meta_info_keys=["epoch"])


def test_union_adds_new_fields_accepts_equal_duplicates_and_leaves_inputs_alone():
    batch = make(step=1)
    extra = Batch.from_dict(
        {"old_log_probs": [torch.zeros(i + 1) for i in range(4)], "rewards": torch.arange(4, dtype=torch.float32)},
        meta_info={"step": 1, "version": 3},
    )
    merged = batch.union(extra)
    assert sorted(merged.keys()) == ["old_log_probs", "responses", "rewards", "uid"]
    assert merged.meta_info == {"step": 1, "version": 3}
    assert "old_log_probs" not in batch and batch.meta_info == {"step": 1}
    assert merged["old_log_probs"].equal(extra["old_log_probs"])


def test_union_rejects_conflicts_and_length_mismatch():
    batch = make()
    with pytest.raises(ValueError, match="union of batches with 4 and 3 samples"):
        batch.union(make(3))
    other = make()
    other["rewards"] = torch.ones(4)
    with pytest.raises(ValueError, match="field 'rewards' differs"):
        batch.union(other)
    # A field of the same values but another kind (fixed vs jagged) is a conflict, too.
    other = make()
    other["rewards"] = [torch.tensor([float(i)]) for i in range(4)]
    with pytest.raises(ValueError, match="field 'rewards' differs"):
        batch.union(other)
    with pytest.raises(ValueError, match=r"meta_info\['step'\] differs"):
        make(step=1).union(make(step=2))


def test_chunk_pad_and_unpad_errors_name_the_sizes():
    batch = make(10)
    with pytest.raises(ValueError, match=r"cannot chunk a batch of 10 samples into 4 equal parts \(10 % 4 = 2\)"):
        batch.chunk(4)
    with pytest.raises(ValueError, match="positive number of parts, got 0"):
        batch.chunk(0)
    with pytest.raises(ValueError, match="positive divisor, got -2"):
        batch.pad_to_divisible(-2)
    with pytest.raises(ValueError, match="cannot remove 11 padding samples from a batch of 10"):
        batch.unpad(11)
    with pytest.raises(ValueError, match="positive count, got 0"):
        batch.repeat(0)
    padded, pad_count = batch.pad_to_divisible(4)
    assert (len(padded), pad_count) == (12, 2)
    assert batch.pad_to_divisible(5) == (batch, 0)


def test_padding_a_batch_shorter_than_the_padding_cycles_its_rows():
    padded, pad_count = make(1).pad_to_divisible(4)
    assert pad_count == 3 and list(padded["uid"]) == ["u0"] * 4


def test_mismatched_sizes_and_layouts_are_named():
    with pytest.raises(ValueError, match="field 'uid' has 3 samples but the batch has 4"):
        Batch.from_dict({"rewards": torch.zeros(4), "uid": ["a", "b", "c"]})
    with pytest.raises(ValueError, match="field 'mask' has 5 samples but the batch has 4"):
        make()["mask"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"0-d tensors"):
        Batch({"score": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="batch 1 has fields"):
        Batch.concat([make(), make().select(["responses", "uid"])])
    with pytest.raises(ValueError, match="at least one batch"):
        Batch.concat([])
    with pytest.raises(ValueError, match=r"meta_info\['step'\] differs"):
        Batch.concat([make(step=1), make(step=2)])
    with pytest.raises(KeyError, match="sample 1 has no key 'b'"):
        Batch.from_lists([{"a": 1, "b": 2}, {"a": 1}])


def test_lookup_errors_name_the_available_fields():
    batch = make()
    with pytest.raises(KeyError, match=r"no field 'values'; the batch has \['responses', 'rewards', 'uid'\]"):
        batch["values"]
    with pytest.raises(KeyError, match="field 'rewards' is not jagged"):
        batch.as_padded("rewards")
    with pytest.raises(IndexError, match="sample 4 out of range for a batch of 4"):
        batch[4]
    with pytest.raises(IndexError, match="out of range for a batch of 4"):
        batch[[0, 7]]
    with pytest.raises(TypeError, match="integers or booleans"):
        batch[torch.tensor([0.5])]


def test_setting_a_field_replaces_it_across_kinds():
    batch = make()
    batch["rewards"] = [torch.ones(2)] * 4
    assert isinstance(batch["rewards"], JaggedTensor) and "rewards" not in batch.tensors
    batch["rewards"] = np.array(["a", "b", "c", "d"])
    assert list(batch["rewards"]) == ["a", "b", "c", "d"]
    del batch["rewards"]
    assert "rewards" not in batch


def test_meta_info_is_copied_not_shared_by_derived_batches():
    batch = make(step=1)
    part = batch[:2]
    part.meta_info["step"] = 2
    assert batch.meta_info["step"] == 1
