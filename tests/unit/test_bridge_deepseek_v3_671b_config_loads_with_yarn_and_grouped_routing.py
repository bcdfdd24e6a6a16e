"""The 671B recipe's model config (recipes/deepseek_v3/models/DeepSeek-V3.json) goes through the DeepSeek-V3 bridge
on a scaled-down shape that keeps its RoPE (YaRN) and routing settings: the TransformerConfig carries the same
YaRN parameters, sigmoid group-limited top-k with expert bias and scaling, and the MTP layer is dropped with a
start-up warning."""

from __future__ import annotations

import json
import pathlib

import pytest

RECIPE_MODEL = pathlib.Path(__file__).parents[2] / "recipes/deepseek_v3/models/DeepSeek-V3.json"
# Sizes only: every RoPE, routing and layer-pattern setting stays as published.
SCALED = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
          "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 16, "vocab_size": 512}


@pytest.fixture(scope="module")
def fields():
    from transformers import DeepseekV3Config

    from bridges.registry import bridge_for

    published = json.loads(RECIPE_MODEL.read_text())
    kept = {k: v for k, v in published.items() if k not in ("architectures", "model_type")}
    config = DeepseekV3Config(**{**kept, **SCALED})
    config.architectures = published["architectures"]
    with pytest.warns(UserWarning, match="1 multi-token-prediction layer"):
        return published, bridge_for(config).config_fields()


def test_yarn_rope_as_published(fields):
    published, f = fields
    yarn = published["rope_scaling"]
    assert f["rope_type"] == "yarn" and f["rotary_base"] == published["rope_theta"]
    assert (f["rotary_scaling_factor"], f["original_max_position_embeddings"]) == (40.0, 4096)
    assert (f["beta_fast"], f["beta_slow"], f["mscale"], f["mscale_all_dim"]) == (
        yarn["beta_fast"], yarn["beta_slow"], yarn["mscale"], yarn["mscale_all_dim"])


def test_grouped_sigmoid_routing_and_dense_prefix_as_published(fields):
    published, f = fields
    assert f["moe_router_score_function"] == "sigmoid" and f["moe_router_enable_expert_bias"]
    assert (f["moe_router_topk"], f["moe_router_num_groups"], f["moe_router_group_topk"]) == (8, 8, 4)
    assert f["moe_router_topk_scaling_factor"] == published["routed_scaling_factor"]
    assert f["moe_layer_freq"] == [0, 0, 0, 1]  # first_k_dense_replace = 3


def test_the_transformer_config_builds(fields):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    _, f = fields
    config = MLATransformerConfig(**f)
    assert config.rope_type == "yarn" and config.rotary_scaling_factor == 40.0
