"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention, routed SwiGLU experts with a softmax top-k router.

HF keeps experts fused in memory (transformers 5) but per-expert in safetensors; the table names the files.
"""

from __future__ import annotations

from typing import Any

from bridges.families.moe import routed_experts
from bridges.families.qwen3 import Qwen3Bridge
from bridges.mapping import Mapping
from bridges.registry import register


@register("Qwen3MoeForCausalLM")
class Qwen3MoeBridge(Qwen3Bridge):
    def config_fields(self) -> dict[str, Any]:
        c = self.hf_config
        sparse = [
            int(c.num_experts > 0 and i not in c.mlp_only_layers and (i + 1) % c.decoder_sparse_step == 0)
            for i in range(c.num_hidden_layers)
        ]
        return {
            **super().config_fields(),
            "num_moe_experts": c.num_experts,
            "moe_router_topk": c.num_experts_per_tok,
            "moe_ffn_hidden_size": c.moe_intermediate_size,
            "moe_layer_freq": sparse,
            "moe_router_score_function": "softmax",
            # Megatron's default softmax-over-the-top-k equals HF's normalised top-k probabilities;
            # without normalisation HF takes the top-k of the full softmax.
            "moe_router_pre_softmax": not c.norm_topk_prob,
            "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": float(getattr(c, "router_aux_loss_coef", 0.0)),
        }

    def mlp_mappings(self) -> list[Mapping]:
        # Dense layers (mlp_only_layers) keep Llama's MLP; the patterns simply match no MoE layer.
        return [*super().mlp_mappings(), *routed_experts()]
