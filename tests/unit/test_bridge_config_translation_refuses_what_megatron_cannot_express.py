"""HF config → Megatron fields: MoE layer patterns, router settings, RoPE scaling; settings Megatron cannot
express raise NotImplementedError naming them instead of being approximated."""

from __future__ import annotations

import pytest

from bridges import bridge_for
from mrl.models.tiny import tiny_hf_config

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_registry_picks_the_family_by_architecture():
    for family, name in [
        ("llama", "LlamaBridge"),
        ("qwen2", "Qwen2Bridge"),
        ("qwen3_moe", "Qwen3MoeBridge"),
        ("deepseek_v3", "DeepseekV3Bridge"),
    ]:
        config = tiny_hf_config(family)
        assert type(bridge_for(config)).__name__ == name
    config = tiny_hf_config("llama")
    config.architectures = ["NoSuchForCausalLM"]
    with pytest.raises(KeyError, match="NoSuchForCausalLM"):
        bridge_for(config)


def test_llama3_rope_scaling_maps_to_megatron_and_other_constants_are_refused():
    kwargs = bridge_for(tiny_hf_config("llama", rope_parameters=LLAMA3_ROPE)).model_kwargs()
    assert kwargs["rope_scaling"] is True and kwargs["rope_scaling_factor"] == 8.0
    assert kwargs["rotary_base"] == 500000
    odd = {**LLAMA3_ROPE, "high_freq_factor": 2.0}
    with pytest.raises(NotImplementedError, match="high_freq_factor"):
        bridge_for(tiny_hf_config("llama", rope_parameters=odd)).model_kwargs()
    with pytest.raises(NotImplementedError, match="yarn"):
        bridge_for(
            tiny_hf_config("llama", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
        ).model_kwargs()


def test_qwen3_moe_dense_layers_and_router_normalisation():
    fields = bridge_for(
        tiny_hf_config("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[1], decoder_sparse_step=1)
    ).config_fields()
    assert fields["moe_layer_freq"] == [1, 0, 1, 1]
    assert fields["moe_router_pre_softmax"] is False
    fields = bridge_for(
        tiny_hf_config("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=False)
    ).config_fields()
    assert fields["moe_layer_freq"] == [0, 1, 0, 1]
    assert fields["moe_router_pre_softmax"] is True


def test_deepseek_v3_first_dense_layers_shared_experts_and_skipped_mtp():
    config = tiny_hf_config("deepseek_v3", num_hidden_layers=3, first_k_dense_replace=2, num_nextn_predict_layers=1)
    with pytest.warns(UserWarning, match="multi-token-prediction"):
        fields = bridge_for(config).config_fields()
    assert fields["moe_layer_freq"] == [0, 0, 1]
    assert fields["moe_shared_expert_intermediate_size"] == config.n_shared_experts * config.moe_intermediate_size
    assert fields["moe_router_score_function"] == "sigmoid" and fields["moe_router_enable_expert_bias"]
    assert (fields["moe_router_num_groups"], fields["moe_router_group_topk"]) == (config.n_group, config.topk_group)
    with pytest.raises(NotImplementedError, match="norm_topk_prob"):
        bridge_for(tiny_hf_config("deepseek_v3", norm_topk_prob=False)).config_fields()


def test_llama_biases_are_refused_rather_than_dropped():
    with pytest.raises(NotImplementedError, match="attention_bias"):
        bridge_for(tiny_hf_config("llama", attention_bias=True)).config_fields()


def test_backend_choice_is_validated_and_megatron_bridge_is_optional():
    config = tiny_hf_config("llama")
    with pytest.raises(ValueError, match=r"bridge\.backend"):
        bridge_for(config, backend="nope")
    try:
        import megatron.bridge  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="megatron-bridge"):
            bridge_for(config, backend="megatron_bridge")
