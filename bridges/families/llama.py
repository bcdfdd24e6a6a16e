"""Llama 3 (LlamaForCausalLM): the dense decoder that Qwen2 and Qwen3 extend.

RMSNorm, SwiGLU MLP, GQA attention without biases, RoPE (plain or Llama-3 frequency scaling).
"""

from __future__ import annotations

from typing import Any

import torch

from bridges.bridge import Bridge, rope_model_kwargs
from bridges.mapping import QKV, GateUp, Mapping, Replicated, RowParallel, Tied, Vocab
from bridges.registry import register


@register("LlamaForCausalLM")
class LlamaBridge(Bridge):
    def config_fields(self) -> dict[str, Any]:
        c = self.hf_config
        if c.hidden_act != "silu":
            raise NotImplementedError(f"{type(self).__name__}: hidden_act {c.hidden_act!r} (only silu)")
        if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
            raise NotImplementedError(f"{type(self).__name__}: attention_bias / mlp_bias")
        return dict(
            num_layers=c.num_hidden_layers,
            hidden_size=c.hidden_size,
            ffn_hidden_size=c.intermediate_size,
            num_attention_heads=c.num_attention_heads,
            num_query_groups=c.num_key_value_heads,
            kv_channels=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            normalization="RMSNorm",
            layernorm_epsilon=c.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            add_qkv_bias=False,
            qk_layernorm=False,
            attention_softmax_in_fp32=True,
        )

    def model_kwargs(self) -> dict[str, Any]:
        c = self.hf_config
        return dict(
            vocab_size=c.vocab_size,
            max_sequence_length=c.max_position_embeddings,
            share_embeddings_and_output_weights=bool(c.tie_word_embeddings),
            **rope_model_kwargs(c),
        )

    def attention_mappings(self) -> list[Mapping]:
        a = "model.layers.*.self_attn."
        return [
            QKV(
                "decoder.layers.*.self_attention.linear_qkv.weight",
                a + "q_proj.weight",
                a + "k_proj.weight",
                a + "v_proj.weight",
            ),
            RowParallel("decoder.layers.*.self_attention.linear_proj.weight", a + "o_proj.weight"),
        ]

    def mlp_mappings(self) -> list[Mapping]:
        m = "model.layers.*.mlp."
        return [
            GateUp("decoder.layers.*.mlp.linear_fc1.weight", m + "gate_proj.weight", m + "up_proj.weight"),
            RowParallel("decoder.layers.*.mlp.linear_fc2.weight", m + "down_proj.weight"),
        ]

    def mappings(self) -> list[Mapping]:
        output = Tied if self.hf_config.tie_word_embeddings else Vocab
        return [
            Vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
            Replicated("decoder.layers.*.input_layernorm.weight", "model.layers.*.input_layernorm.weight"),
            *self.attention_mappings(),
            Replicated("decoder.layers.*.pre_mlp_layernorm.weight", "model.layers.*.post_attention_layernorm.weight"),
            *self.mlp_mappings(),
            Replicated("decoder.final_layernorm.weight", "model.norm.weight"),
            output("output_layer.weight", "model.embed_tokens.weight" if output is Tied else "lm_head.weight"),
        ]
