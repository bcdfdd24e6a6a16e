"""The parameter count `mrl plan` reads from a config.json equals the parameters of the HF model built from it, for
every supported family (attention biases, q/k norms, MLA, routed and shared experts, dense-first layers, tied
embeddings), and a local model folder wins over the built-in table."""

import json

import pytest

from mrl.config.model_shape import builtin_configs, resolve_model_config, shape_from_config
from mrl.models.tiny import FAMILIES, build_tiny_hf_model, tiny_hf_config
from mrl.tools.plan import make_plan


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_equals_the_hf_models(family, tied):
    model = build_tiny_hf_model(family, tie_word_embeddings=tied)
    shape = shape_from_config(tiny_hf_config(family, tie_word_embeddings=tied).to_dict())
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    assert shape.is_moe == (family in ("qwen3_moe", "deepseek_v3"))


def test_published_shapes_give_published_sizes():
    sizes = {name: shape_from_config(json.loads(path.read_text())) for name, path in builtin_configs().items()}
    billions = {name: (round(s.total_params / 1e9, 1), round(s.active_params / 1e9, 1)) for name, s in sizes.items()}
    assert billions == {
        "llama-3.1-8b": (8.0, 8.0), "qwen2.5-7b": (7.6, 7.6), "qwen3-8b": (8.2, 8.2),
        "qwen3-30b-a3b": (30.5, 3.4), "qwen3-235b-a22b": (235.1, 22.2), "deepseek-v3": (671.0, 37.6),
    }


def test_a_local_config_json_wins_over_the_builtin_name(tmp_path):
    folder = tmp_path / "Qwen3-8B"  # named like a built-in entry on purpose
    tiny_hf_config("qwen3").save_pretrained(folder)
    config, source = resolve_model_config(str(folder))
    assert source == str(folder / "config.json") and config["hidden_size"] == 128
    plan = make_plan("qwen3/8b_grpo", [f"model.path={folder}"])
    assert plan.total_params == shape_from_config(config).total_params


def test_unknown_model_names_the_builtin_choices():
    with pytest.raises(FileNotFoundError, match="Qwen3-8B"):
        resolve_model_config("/nowhere/NotAModel")
