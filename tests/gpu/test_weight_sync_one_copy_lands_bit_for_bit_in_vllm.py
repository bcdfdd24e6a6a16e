"""`ipc` with `one_copy` into a live vLLM on the GPU (sleep mode on, as in hybrid runs): the trainer shares its own
tensors' memory (views at storage offsets and strided views, fp32 norms into a bf16 engine, a vocabulary the engine
pads) and the engine copies every HF tensor straight into its parameters; read back, the engine's parameters equal
the export bit for bit, every tensor went the direct way (none through the model's loaders), and the same holds
for a second sync after a level-2 sleep and wake (the engine's weights discarded and re-mapped at their addresses),
in which every tensor of its own storage is shared by its own handle instead of in the staging ring, and for a third
whose q/k/v come as the bridge's row blocks of a Megatron linear_qkv (bridges/export.py `row_blocks`)."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from rollout_adapters.vllm.adapter import WORKER_EXTENSION
from rollout_adapters.vllm.readback import mismatched_params

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)  # vLLM pads 1000 rows to 1024


def hf_export(seed: int) -> dict[str, torch.Tensor]:
    """Random HF-named tensors shaped like a Megatron export: q/k/v as views of one tensor (storage offsets), gate
    and up as strided views of a transposed one, norms in fp32."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h, inter, layers = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_hidden_layers"]
    hd = h // SHAPE["num_attention_heads"]
    kv = SHAPE["num_key_value_heads"] * hd

    def rand(*size: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*size, generator=g, device="cuda").to(dtype)

    out = {"model.embed_tokens.weight": rand(SHAPE["vocab_size"], h), "lm_head.weight": rand(SHAPE["vocab_size"], h),
           "model.norm.weight": rand(h, dtype=torch.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for kind, qkv in (("weight", rand(h + 2 * kv, h)), ("bias", rand(h + 2 * kv))):
            out[f"{p}self_attn.q_proj.{kind}"] = qkv[:h]
            out[f"{p}self_attn.k_proj.{kind}"] = qkv[h:h + kv]
            out[f"{p}self_attn.v_proj.{kind}"] = qkv[h + kv:]
        gate_up = rand(h, 2 * inter).t()  # non-contiguous rows
        out[f"{p}mlp.gate_proj.weight"], out[f"{p}mlp.up_proj.weight"] = gate_up[:inter], gate_up[inter:]
        out[f"{p}self_attn.o_proj.weight"] = rand(h, h)
        out[f"{p}mlp.down_proj.weight"] = rand(h, inter)
        out[f"{p}input_layernorm.weight"] = rand(h, dtype=torch.float32)
        out[f"{p}post_attention_layernorm.weight"] = rand(h, dtype=torch.float32)
    return out


def with_row_blocks(exported: dict[str, torch.Tensor]) -> list[tuple]:
    """The stream as the one-copy export sends it: each layer's q/k/v (weight and bias) as row blocks of one
    Megatron-interleaved linear_qkv, the rest as it is."""
    from bridges.export import ROW_BLOCKS
    from bridges.mapping import QKV, ModelShape, Shard

    heads, groups = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    shape = ModelShape(heads, groups, SHAPE["hidden_size"] // heads)
    mapping, items = QKV("qkv", "q", "k", "v"), []
    for name, tensor in exported.items():
        if ".q_proj." in name:
            parts = [exported[name.replace(".q_proj.", f".{p}_proj.")] for p in "qkv"]
            full = mapping.load(parts, Shard(), shape)
            for part, blocks in zip("qkv", mapping.to_hf_blocks(full, shape)):
                items.append((name.replace(".q_proj.", f".{part}_proj."), blocks, ROW_BLOCKS))
        elif not (".k_proj." in name or ".v_proj." in name):
            items.append((name, tensor))
    return items


def sync(llm, items: list[tuple], bucket_bytes: int) -> int:
    from mrl.weight_sync import make_sender

    sender = make_sender("ipc", 2, bucket_bytes, 120.0, device="cuda", one_copy=True)
    spec = sender.prepare()
    assert spec["one_copy"] and spec["handles"] == []  # no packing buffers
    result: dict = {}
    engine = threading.Thread(target=lambda: result.update(n=llm.collective_rpc("mrl_receive_weights",
                                                                                  args=(spec, 1))))
    engine.start()
    try:
        sender.init_process_group()
        sent = sender.send_weights(iter(items))
        sender.finalize()
    finally:
        sender.finalize(wait=False)
        engine.join(timeout=120)
    assert result["n"] == [len(items)]
    return sent


def read_back(llm) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(llm.collective_rpc("mrl_read_weights")[0])


def test_one_copy_sync_lands_bit_for_bit_in_a_live_vllm_and_again_after_a_level_2_sleep(tmp_path, monkeypatch):
    from transformers import Qwen2Config
    from vllm import LLM

    from mrl.weight_sync import handles

    Qwen2Config(**SHAPE, max_position_embeddings=512, torch_dtype="bfloat16").save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=256, enforce_eager=True, gpu_memory_utilization=0.15, enable_sleep_mode=True,
              worker_extension_cls=WORKER_EXTENSION, seed=0)
    try:
        for seed in (1, 2, 3):
            monkeypatch.setattr(handles, "STAGE_BELOW", 0 if seed == 2 else 64 << 20)  # 2: one handle per storage
            exported = hf_export(seed)
            items = with_row_blocks(exported) if seed == 3 else list(exported.items())
            assert sync(llm, items, bucket_bytes=96 << 10) == len(exported)  # many buckets: the ring is reused
            stats = llm.collective_rpc("mrl_load_stats")[0]
            print(json.dumps({"seed": seed, **stats}))
            assert stats["one_copy"] and stats["loader_tensors"] == 0, stats
            assert stats["direct_tensors"] == len(exported)
            assert mismatched_params(read_back(llm), {k: v.cpu() for k, v in exported.items()}) == []
            llm.sleep(level=2)  # discards the weights; wake maps new memory at the same addresses
            llm.wake_up()
    finally:
        del llm
