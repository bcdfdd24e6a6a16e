"""rollout.quantization=fp8 on the export stream (mrl/weight_sync/fp8.py): every attention and MLP projection (dense
and per-expert) becomes e4m3 bytes followed by `<name>_scale_inv`; norms, biases, embeddings, the output layer and
the MoE router pass unchanged. A TP slice of whole 128-row blocks quantises to the same rows (and scale rows) as the
whole tensor; a slice that cuts a block, and one-copy row blocks, are refused naming the tensor. The block-FP8
folder the vllm adapter starts its engine from holds exactly the quantised stream, vLLM's quantization_config
and every full-precision 2-D weight in `ignored_layers`, across safetensors shards."""

import json

import pytest
import torch
from safetensors.torch import load_file

from bridges.export import ROW_BLOCKS, TpSlice
from mrl.models.tiny import make_tiny_hf_model
from mrl.weight_sync.fp8 import FP8_DTYPE, QUANTIZATION_CONFIG, SCALE_SUFFIX, quantize, quantized_stream
from mrl.weight_sync.fp8 import write_quantized_copy as write_copy


def saved(folder) -> dict[str, torch.Tensor]:
    """The HF-named tensors of a model folder: what a bridge export streams (per-expert names for MoE)."""
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_linear_weights_become_fp8_with_scales_and_the_rest_passes(family, tmp_path):
    hf = saved(make_tiny_hf_model(family, tmp_path, tokenizer=False, dtype=torch.bfloat16))
    out = list(quantized_stream(hf.items()))
    names = [n for n, _ in out]
    sent = dict(out)
    projections = [n for n in hf if n.endswith("_proj.weight")]
    assert projections and any(".experts." in n for n in projections) == (family == "qwen3_moe")
    for name in projections:
        assert sent[name].dtype == FP8_DTYPE and sent[name].shape == hf[name].shape
        # the scale comes after its weight, with only its module's weights and scales between them
        module, at, scale_at = name.rsplit(".", 2)[0], names.index(name), names.index(name + SCALE_SUFFIX)
        assert at < scale_at and all(n.rsplit(".", 2)[0] == module for n in names[at:scale_at])
        q, scale = quantize(hf[name])
        assert torch.equal(sent[name].view(torch.uint8), q.view(torch.uint8)) and torch.equal(sent[name + SCALE_SUFFIX],
                                                                                              scale)
    kept = [n for n in hf if n not in projections]
    assert any("norm" in n for n in kept) and "model.embed_tokens.weight" in kept
    assert any(n.endswith(".bias") for n in kept) == (family == "qwen2")
    assert any(n.endswith("mlp.gate.weight") for n in kept) == (family == "qwen3_moe")  # the router
    for name in kept:
        assert sent[name] is hf[name]
    assert len(out) == len(hf) + len(projections)


def test_a_modules_scales_follow_its_last_weight_so_fused_projections_stay_back_to_back():
    w = torch.ones(128, 128, dtype=torch.bfloat16)
    stream = [(f"l.attn.{p}_proj.weight", w) for p in "qkvo"] + [("l.norm.weight", w[0])] + \
        [(f"l.mlp.{p}_proj.weight", w) for p in ("gate", "up", "down")]
    spent: dict[str, float] = {}
    names = [n for n, *_ in quantized_stream(stream, spent=spent)]
    assert spent["quantize_s"] > 0  # the host seconds a sync's metrics report as timing_s/sync/quantize
    untouched: dict[str, float] = {}
    assert [n for n, *_ in quantized_stream(stream[4:5], spent=untouched)] == ["l.norm.weight"] and not untouched
    attn, mlp = [f"l.attn.{p}_proj.weight" for p in "qkvo"], [f"l.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    assert names == attn + [n + SCALE_SUFFIX for n in attn] + ["l.norm.weight"] + mlp + [n + SCALE_SUFFIX for n in mlp]


def test_a_tp_slice_of_whole_blocks_is_the_whole_tensors_rows():
    g = torch.Generator().manual_seed(0)
    full = torch.randn(512, 200, generator=g).to(torch.bfloat16)
    q, scale = quantize(full)
    for rank in range(2):
        part = full[rank * 256:(rank + 1) * 256]
        tag = TpSlice(0, rank, 2)
        (name, q_part, t1), (scale_name, s_part, t2) = quantized_stream([("l.o_proj.weight", part, tag)])
        assert (name, scale_name, t1, t2) == ("l.o_proj.weight", "l.o_proj.weight_scale_inv", tag, tag)
        assert torch.equal(q_part.view(torch.uint8), q[rank * 256:(rank + 1) * 256].view(torch.uint8))
        assert torch.equal(s_part, scale[rank * 2:(rank + 1) * 2])
    with pytest.raises(ValueError, match=r"l\.o_proj\.weight's TP slice has 100 rows"):
        list(quantized_stream([("l.o_proj.weight", full[:100], TpSlice(0, 0, 2))]))
    with pytest.raises(ValueError, match=r"l\.q_proj\.weight arrived as row blocks"):
        list(quantized_stream([("l.q_proj.weight", full.view(4, 128, 200), ROW_BLOCKS)]))


def test_the_engines_folder_holds_the_quantised_stream_and_vllms_config(tmp_path):
    src = make_tiny_hf_model("qwen3_moe", tmp_path / "bf16", dtype=torch.bfloat16, max_shard_size="200KB")
    assert len(list(src.glob("*.safetensors"))) > 1
    copy = tmp_path / "fp8"
    assert write_copy(str(src), str(copy)) == str(copy)
    expected = dict(quantized_stream(saved(src).items()))
    written = saved(copy)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[n].view(torch.uint8), expected[n].view(torch.uint8)) for n in expected)
    index = json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"]
    assert index.keys() == expected.keys() and all((copy / f).is_file() for f in index.values())
    config = json.loads((copy / "config.json").read_text())
    quant = config.pop("quantization_config")
    assert {k: quant[k] for k in QUANTIZATION_CONFIG} == QUANTIZATION_CONFIG
    ignored = set(quant["ignored_layers"])
    assert "model.embed_tokens" in ignored and "model.layers.0.mlp.gate" in ignored  # embedding, router
    assert not any("_proj" in n or "norm" in n for n in ignored)
    assert config == json.loads((src / "config.json").read_text())
    assert (copy / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    (copy / "marker").write_text("kept")
    write_copy(str(src), str(copy))  # a copy already in place is reused (engines of one node share it)
    assert (copy / "marker").is_file()
