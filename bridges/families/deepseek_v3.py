"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-latent attention, first-k dense layers, then MoE layers with
shared experts and a sigmoid router with expert-bias (aux-loss-free) and group-limited top-k.

Multi-token-prediction layers (HF `model.layers.{num_hidden_layers + i}`) are not built and not imported.
"""

from __future__ import annotations

import warnings
from typing import Any

from bridges.bridge import rope_parameters
from bridges.families.llama import LlamaBridge
from bridges.families.moe import routed_experts, shared_experts
from bridges.mapping import ColumnParallel, Mapping, Replicated, RowParallel
from bridges.registry import register


@register("DeepseekV3ForCausalLM")
class DeepseekV3Bridge(LlamaBridge):
    def config_class(self) -> type:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig

    def config_fields(self) -> dict[str, Any]:
        c = self.hf_config
        if getattr(c, "num_nextn_predict_layers", 0):
            warnings.warn(
                f"DeepSeek-V3: {c.num_nextn_predict_layers} multi-token-prediction layer(s) skipped: not built, "
                "not imported, not exported",
                stacklevel=2,
            )
        if not c.norm_topk_prob:
            raise NotImplementedError("DeepSeek-V3 with norm_topk_prob=False: Megatron always normalises sigmoid top-k")
        rope = rope_parameters(c)
        if rope["rope_type"] != "default":
            raise NotImplementedError(f"DeepSeek-V3 RoPE type {rope['rope_type']!r} (YaRN mapping not verified)")
        fields = super().config_fields()
        fields.pop("kv_channels")
        fields.pop("num_query_groups")
        dense = min(c.first_k_dense_replace, c.num_hidden_layers)
        return {
            **fields,
            "qk_layernorm": True,  # turns the q/kv latent norms on in the local MLA spec
            "q_lora_rank": c.q_lora_rank,
            "kv_lora_rank": c.kv_lora_rank,
            "qk_head_dim": c.qk_nope_head_dim,
            "qk_pos_emb_head_dim": c.qk_rope_head_dim,
            "v_head_dim": c.v_head_dim,
            "rope_type": "rope",
            "rotary_base": rope["rope_theta"],
            "rotary_scaling_factor": 1.0,
            "num_moe_experts": c.n_routed_experts,
            "moe_router_topk": c.num_experts_per_tok,
            "moe_ffn_hidden_size": c.moe_intermediate_size,
            "moe_shared_expert_intermediate_size": c.n_shared_experts * c.moe_intermediate_size,
            "moe_layer_freq": [0] * dense + [1] * (c.num_hidden_layers - dense),
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": c.n_group,
            "moe_router_group_topk": c.topk_group,
            "moe_router_topk_scaling_factor": c.routed_scaling_factor,
            "moe_router_dtype": "fp32",  # HF computes router logits in fp32
            "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0,
        }

    def ignored_hf_names(self, names: set[str]) -> set[str]:
        # Multi-token-prediction layers follow the decoder layers in HF numbering; they are not built.
        first_mtp = self.hf_config.num_hidden_layers
        mtp = {n for n in names if n.startswith("model.layers.") and int(n.split(".")[2]) >= first_mtp}
        return super().ignored_hf_names(names) | mtp

    def attention_mappings(self) -> list[Mapping]:
        a, s = "model.layers.*.self_attn.", "decoder.layers.*.self_attention."
        if self.hf_config.q_lora_rank is None:
            query = [ColumnParallel(s + "linear_q_proj.weight", a + "q_proj.weight")]
        else:
            query = [
                ColumnParallel(s + "linear_q_down_proj.weight", a + "q_a_proj.weight"),
                Replicated(s + "q_layernorm.weight", a + "q_a_layernorm.weight"),
                ColumnParallel(s + "linear_q_up_proj.weight", a + "q_b_proj.weight"),
            ]
        return [
            *query,
            ColumnParallel(s + "linear_kv_down_proj.weight", a + "kv_a_proj_with_mqa.weight"),
            Replicated(s + "kv_layernorm.weight", a + "kv_a_layernorm.weight"),
            ColumnParallel(s + "linear_kv_up_proj.weight", a + "kv_b_proj.weight"),
            RowParallel(s + "linear_proj.weight", a + "o_proj.weight"),
        ]

    def mlp_mappings(self) -> list[Mapping]:
        bias = Replicated("decoder.layers.*.mlp.router.expert_bias", "model.layers.*.mlp.gate.e_score_correction_bias")
        return [*super().mlp_mappings(), *routed_experts(), bias, *shared_experts()]
