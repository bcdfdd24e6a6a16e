"""Tiny HF models: every family saves and reloads offline with identical weights and logits, seeds are
deterministic, logits are spread enough for parity tests to mean something, and sharded saves have an index."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from mrl.models.tiny import FAMILIES, build_tiny_hf_model, make_tiny_hf_model, tiny_hf_config, train_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny_tokenizer()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """One saved model per family (seed 0), shared by the tests of this module."""
    root = tmp_path_factory.mktemp("tiny")
    return {family: make_tiny_hf_model(family, root / family, tokenizer=tokenizer) for family in FAMILIES}


def _tokens(n: int = 24) -> torch.Tensor:
    return torch.randint(0, 512, (2, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", FAMILIES)
def test_reload_gives_identical_weights_and_logits(family, saved, tokenizer):
    path = saved[family]
    in_memory = build_tiny_hf_model(family, seed=0, tokenizer=tokenizer)
    reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
    assert reloaded.dtype == torch.float32
    assert AutoConfig.from_pretrained(path).model_type == family
    expected = in_memory.state_dict()
    got = reloaded.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    with torch.no_grad():
        logits = in_memory(_tokens()).logits
        assert torch.equal(logits, reloaded(_tokens()).logits)
    # Logits vary across the vocabulary, so parity comparisons downstream are not vacuous.
    assert logits.std(dim=-1).min() > 0.3
    assert torch.isfinite(logits).all()


def test_bf16_save_is_the_rounded_fp32_model(tmp_path, saved):
    path = make_tiny_hf_model("qwen3", tmp_path / "bf16", tokenizer=False, dtype=torch.bfloat16)
    assert AutoModelForCausalLM.from_pretrained(path).dtype == torch.bfloat16
    half, full = load_file(path / "model.safetensors"), load_file(saved["qwen3"] / "model.safetensors")
    assert all(torch.equal(half[k], full[k].to(torch.bfloat16)) for k in full)


def test_same_seed_same_tensors_other_seed_differs(tmp_path):
    a = load_file(make_tiny_hf_model("qwen3_moe", tmp_path / "a", seed=3, tokenizer=False) / "model.safetensors")
    b = load_file(make_tiny_hf_model("qwen3_moe", tmp_path / "b", seed=3, tokenizer=False) / "model.safetensors")
    c = load_file(make_tiny_hf_model("qwen3_moe", tmp_path / "c", seed=4, tokenizer=False) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a)


def test_building_a_model_leaves_the_global_rng_untouched(tmp_path):
    before = torch.get_rng_state()
    make_tiny_hf_model("llama", tmp_path / "m", tokenizer=False)
    assert torch.equal(before, torch.get_rng_state())


def test_sharded_save_has_index_and_reloads_equal(tmp_path, saved):
    path = make_tiny_hf_model("qwen2", tmp_path / "sharded", tokenizer=False, max_shard_size="300KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert all((path / shard).exists() for shard in shards)
    merged = {k: v for shard in shards for k, v in load_file(path / shard).items()}
    single = load_file(saved["qwen2"] / "model.safetensors")
    assert merged.keys() == single.keys()
    assert all(torch.equal(merged[k], single[k]) for k in single)


def test_family_shapes_and_special_token_ids(tokenizer):
    llama = tiny_hf_config("llama")
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim) == (4, 2, 32)
    assert not llama.tie_word_embeddings
    assert tiny_hf_config("llama", tie_word_embeddings=True).tie_word_embeddings
    moe = tiny_hf_config("qwen3_moe")
    assert moe.norm_topk_prob and moe.decoder_sparse_step == 1 and moe.num_experts_per_tok == 2
    ds = tiny_hf_config("deepseek_v3")
    assert ds.first_k_dense_replace == 1 and ds.n_routed_experts % ds.n_group == 0
    assert ds.topk_group <= ds.n_group and ds.num_nextn_predict_layers == 0
    # Without a tokenizer the config uses the fixed special-token order every tiny tokenizer shares.
    for family in FAMILIES:
        config = tiny_hf_config(family)
        assert config.eos_token_id == tokenizer.eos_token_id
        assert config.pad_token_id == tokenizer.pad_token_id
    with pytest.raises(ValueError, match="unknown tiny model family 'gpt2'"):
        tiny_hf_config("gpt2")
