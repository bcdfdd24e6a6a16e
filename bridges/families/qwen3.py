"""Qwen3 (Qwen3ForCausalLM): Llama plus per-head RMSNorm on queries and keys (q_norm / k_norm)."""

from __future__ import annotations

from typing import Any

from bridges.families.llama import LlamaBridge
from bridges.mapping import Mapping, Replicated
from bridges.registry import register


@register("Qwen3ForCausalLM")
class Qwen3Bridge(LlamaBridge):
    def config_fields(self) -> dict[str, Any]:
        return {**super().config_fields(), "qk_layernorm": True}

    def attention_mappings(self) -> list[Mapping]:
        a = "model.layers.*.self_attn."
        return [
            *super().attention_mappings(),
            Replicated("decoder.layers.*.self_attention.q_layernorm.weight", a + "q_norm.weight"),
            Replicated("decoder.layers.*.self_attention.k_layernorm.weight", a + "k_norm.weight"),
        ]
