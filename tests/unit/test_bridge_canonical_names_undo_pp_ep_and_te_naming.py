"""Canonical names: local layer indices become global, local expert ids get the EP offset, TE names the local ones."""

from __future__ import annotations

import pytest

from bridges.names import canonical_name, with_expert


@pytest.mark.parametrize(
    ("local", "layers", "offset", "expected"),
    [
        (
            "decoder.layers.0.self_attention.linear_qkv.weight",
            {0: 5},
            0,
            "decoder.layers.5.self_attention.linear_qkv.weight",
        ),
        (
            "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight",
            {1: 7},
            4,
            "decoder.layers.7.mlp.experts.local_experts.6.linear_fc2.weight",
        ),
        (
            "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
            {0: 2},
            0,
            "decoder.layers.2.input_layernorm.weight",
        ),
        ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", {0: 0}, 0, "decoder.layers.0.pre_mlp_layernorm.weight"),
        (
            "decoder.layers.0.mlp.experts.linear_fc1.weight3",
            {0: 1},
            8,
            "decoder.layers.1.mlp.experts.local_experts.11.linear_fc1.weight",
        ),
        ("embedding.word_embeddings.weight", {}, 8, "embedding.word_embeddings.weight"),
        (
            "decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
            {0: 3},
            8,
            "decoder.layers.3.mlp.shared_experts.linear_fc1.weight",
        ),
    ],
)
def test_canonical_name(local, layers, offset, expected):
    assert canonical_name(local, layers, offset) == expected


def test_with_expert_rejects_dense_names():
    assert with_expert("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", 9).endswith(
        "local_experts.9.linear_fc1.weight"
    )
    with pytest.raises(ValueError):
        with_expert("decoder.layers.0.mlp.linear_fc1.weight", 1)
