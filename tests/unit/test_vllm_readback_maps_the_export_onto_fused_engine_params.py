"""The read-back check of a weight sync (rollout_adapters/vllm/readback.py): an HF export maps onto vLLM's fused
parameter names (q/k/v → qkv_proj, gate/up → gate_up_proj, in that order along the output dimension), padded
vocabulary rows are ignored, an fp32 export is compared through its rounding to the engine's dtype, and a single
changed bit or a missing tensor is reported. A block-FP8 export (rollout.quantization=fp8) fuses its scales like its
weights and is compared byte for byte, never cast."""

import torch

from mrl.models.tiny import build_tiny_hf_model
from mrl.weight_sync.fp8 import FP8_DTYPE, quantized_stream
from rollout_adapters.vllm.readback import expected_engine_params, mismatched_params


def export() -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) for k, v in build_tiny_hf_model("qwen2", seed=3).state_dict().items()}


def test_fused_names_and_order():
    hf = export()
    engine = expected_engine_params(hf)
    prefix = "model.layers.1."
    qkv = engine[prefix + "self_attn.qkv_proj.weight"]
    q, k, v = (hf[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(qkv, torch.cat([q, k, v])) and qkv.shape[0] == q.shape[0] + k.shape[0] + v.shape[0]
    assert torch.equal(engine[prefix + "self_attn.qkv_proj.bias"],
                       torch.cat([hf[prefix + f"self_attn.{p}_proj.bias"] for p in "qkv"]))
    gate_up = engine[prefix + "mlp.gate_up_proj.weight"]
    assert torch.equal(gate_up, torch.cat([hf[prefix + "mlp.gate_proj.weight"], hf[prefix + "mlp.up_proj.weight"]]))
    assert not any(".q_proj." in n or ".gate_proj." in n for n in engine)
    assert torch.equal(engine[prefix + "self_attn.o_proj.weight"], hf[prefix + "self_attn.o_proj.weight"])


def test_an_exact_copy_passes_and_every_kind_of_difference_is_named():
    hf = export()
    engine = {k: v.clone() for k, v in expected_engine_params(hf).items()}
    embed = "model.embed_tokens.weight"
    engine[embed] = torch.cat([engine[embed], torch.zeros(64, engine[embed].shape[1], dtype=torch.bfloat16)])
    assert mismatched_params(engine, hf) == []  # padded vocabulary rows are the engine's own
    flipped = dict(engine)
    name = "model.layers.0.mlp.gate_up_proj.weight"
    bits = flipped[name].clone().view(torch.int16)
    bits.view(-1)[17] ^= 1  # one bit of one element
    flipped[name] = bits.view(torch.bfloat16)
    assert mismatched_params(flipped, hf) == [name]
    missing = {k: v for k, v in engine.items() if k != "model.norm.weight"}
    assert mismatched_params(missing, hf) == ["model.norm.weight"]
    fp32_export = {**hf, "model.norm.weight": hf["model.norm.weight"].float() + 1e-4}  # rounds to the same bf16
    assert (fp32_export["model.norm.weight"].to(torch.bfloat16) == hf["model.norm.weight"]).all()
    assert mismatched_params(engine, fp32_export) == []
    off_by_rounding = {**hf, "model.norm.weight": hf["model.norm.weight"].float() * 1.01}
    assert mismatched_params(engine, off_by_rounding) == ["model.norm.weight"]


def test_a_block_fp8_export_fuses_its_scales_and_is_compared_byte_for_byte():
    hf = export()
    fp8 = dict(quantized_stream(hf.items()))
    engine = {k: v.clone() for k, v in expected_engine_params(fp8).items()}
    prefix = "model.layers.0.self_attn."
    assert engine[prefix + "qkv_proj.weight"].dtype == FP8_DTYPE
    assert torch.equal(engine[prefix + "qkv_proj.weight_scale_inv"],
                       torch.cat([fp8[prefix + f"{p}_proj.weight_scale_inv"] for p in "qkv"]))
    assert mismatched_params(engine, fp8) == []
    name = "model.layers.1.mlp.down_proj.weight"
    flipped = engine[name].view(torch.uint8).clone()
    flipped.view(-1)[5] ^= 1
    assert mismatched_params({**engine, name: flipped.view(FP8_DTYPE)}, fp8) == [name]
    scale = prefix + "qkv_proj.weight_scale_inv"
    assert mismatched_params({**engine, scale: engine[scale] * 2}, fp8) == [scale]
    # the unquantised export is not what an FP8 engine holds: its linear weights are never cast to FP8 to compare
    assert name in mismatched_params(engine, {**hf, **{n: t for n, t in fp8.items() if n.endswith("_scale_inv")}})
