"""The HF reader reads only requested slices (sharded index or single file) and counts what is alive; the
writer shards a stream by bytes with an index that the reader and transformers both accept; export buckets
respect their byte limit."""

from __future__ import annotations

import gc

import pytest
import torch
from safetensors.torch import load_file

from bridges.export import Plan, Unit, bucket_bounds
from bridges.hf_io import HFCheckpoint, write_safetensors
from bridges.mapping import ModelShape
from mrl.models.tiny import make_tiny_hf_model


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory):
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("llama"), tokenizer=False, max_shard_size="300KB")


def test_sharded_checkpoint_slices_equal_full_tensors_and_count_bytes(sharded_llama):
    full = {}
    for file in sharded_llama.glob("*.safetensors"):
        full.update(load_file(str(file)))
    assert len(list(sharded_llama.glob("*.safetensors"))) > 1
    with HFCheckpoint(sharded_llama) as checkpoint:
        assert checkpoint.names() == set(full)
        name = "model.layers.1.mlp.down_proj.weight"
        part = checkpoint(name)[:, 64:128]
        assert torch.equal(part, full[name][:, 64:128])
        assert checkpoint.stats.total == part.numel() * 4 == checkpoint.stats.alive
        del part
        gc.collect()
        assert checkpoint.stats.alive == 0
        assert checkpoint.stats.peak == checkpoint.stats.total
        assert torch.equal(checkpoint("model.norm.weight")[...], full["model.norm.weight"])
        with pytest.raises(KeyError, match=r"lm_head\.bias"):
            checkpoint("lm_head.bias")


def test_written_shards_reload_identically(tmp_path):
    tensors = [(f"t{i}", torch.full((256,), float(i))) for i in range(10)]  # 1 KiB each
    files = write_safetensors(iter(tensors), tmp_path, max_shard_bytes=3000)
    per_shard = 3000 // 1024
    assert len(files) == -(-len(tensors) // per_shard)
    with HFCheckpoint(tmp_path) as checkpoint:
        for name, tensor in tensors:
            assert torch.equal(checkpoint(name)[...], tensor)
    single = tmp_path / "single"
    assert write_safetensors(iter(tensors[:2]), single) == ["model.safetensors"]
    with pytest.raises(ValueError, match="twice"):
        write_safetensors(iter([tensors[0], tensors[0]]), tmp_path / "dup")


def _unit(nbytes: int) -> Unit:
    return Unit("n", 0, 0, (), (1,), torch.float32, False, None, nbytes)


def test_buckets_never_exceed_the_limit_unless_one_tensor_does():
    sizes = [100, 300, 50, 600, 10, 10, 1000, 5]
    plan = Plan([_unit(s) for s in sizes], 1, 0, None, ModelShape(1, 1, 1))
    bounds = bucket_bounds(plan, 400)
    assert [i for a, b in bounds for i in range(a, b)] == list(range(len(sizes)))  # every unit once, in order
    for a, b in bounds:
        total = sum(sizes[a:b])
        assert total <= 400 or b - a == 1
    assert bucket_bounds(plan, None) == [(i, i + 1) for i in range(len(sizes))]
