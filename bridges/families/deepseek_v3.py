"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-latent attention, first-k dense layers, then MoE layers with
shared experts and a sigmoid router with expert-bias (aux-loss-free) and group-limited top-k.

Multi-token-prediction layers (HF `model.layers.{num_hidden_layers + i}`) are not built and not imported: RL
trains and samples the main model only; the start-up warning says how many were dropped. RoPE: plain or YaRN (the
published config's), mapped onto Megatron's MLA YaRN.
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
        if rope["rope_type"] not in ("default", "yarn"):
            raise NotImplementedError(f"DeepSeek-V3 RoPE type {rope['rope_type']!r}: default and yarn are mapped")
        if not rope.get("truncate", True):
            raise NotImplementedError("DeepSeek-V3 YaRN with truncate=False: Megatron rounds the correction range")
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
            **_rope_fields(rope),
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

    def model_kwargs(self) -> dict[str, Any]:
        # MLA layers build their own RoPE (plain or YaRN) from the TransformerConfig; GPTModel builds none for MLA.
        c = self.hf_config
        return dict(vocab_size=c.vocab_size, max_sequence_length=c.max_position_embeddings,
                    share_embeddings_and_output_weights=bool(c.tie_word_embeddings), position_embedding_type="rope")

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


def _rope_fields(rope: dict[str, Any]) -> dict[str, Any]:
    """MLA RoPE settings: plain, or YaRN as in the published DeepSeek-V3 config (HF's defaults where it is silent;
    a missing mscale_all_dim is 0 in both, which leaves the softmax scale alone)."""
    if rope["rope_type"] == "default":
        return {"rope_type": "rope", "rotary_base": rope["rope_theta"], "rotary_scaling_factor": 1.0}
    return {
        "rope_type": "yarn",
        "rotary_base": rope["rope_theta"],
        "rotary_scaling_factor": float(rope["factor"]),
        "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
        "beta_fast": float(rope.get("beta_fast", 32.0)),
        "beta_slow": float(rope.get("beta_slow", 1.0)),
        "mscale": float(rope.get("mscale", 1.0)),
        "mscale_all_dim": float(rope.get("mscale_all_dim", 0.0)),
    }
