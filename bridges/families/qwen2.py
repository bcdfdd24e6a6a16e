"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): Llama plus biases on the q/k/v projections (always present)."""

from __future__ import annotations

from typing import Any

from bridges.families.llama import LlamaBridge
from bridges.mapping import QKV, Mapping
from bridges.registry import register


@register("Qwen2ForCausalLM")
class Qwen2Bridge(LlamaBridge):
    def config_fields(self) -> dict[str, Any]:
        return {**super().config_fields(), "add_qkv_bias": True}

    def attention_mappings(self) -> list[Mapping]:
        a = "model.layers.*.self_attn."
        bias = QKV(
            "decoder.layers.*.self_attention.linear_qkv.bias", a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"
        )
        return [*super().attention_mappings(), bias]
