"""The parameter count `mrl plan` reads from a config.json equals the parameters of the HF model built from it, for
every supported family (attention biases, q/k norms, MLA, routed and shared experts, dense-first layers, tied
embeddings), and so do the bytes of a weight export, bf16 and block FP8 (rollout.quantization=fp8), which also match
what an H100 sync carried at 1.5B; a local model folder wins over the built-in table."""

import json

import pytest
import torch
from safetensors import safe_open

from mrl.config.model_shape import builtin_configs, resolve_model_config, shape_from_config
from mrl.models.tiny import FAMILIES, build_tiny_hf_model, make_tiny_hf_model, tiny_hf_config
from mrl.tools.plan import make_plan
from mrl.weight_sync.fp8 import write_quantized_copy


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_equals_the_hf_models(family, tied):
    model = build_tiny_hf_model(family, tie_word_embeddings=tied)
    shape = shape_from_config(tiny_hf_config(family, tie_word_embeddings=tied).to_dict())
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    assert shape.is_moe == (family in ("qwen3_moe", "deepseek_v3"))


def _folder_bytes(folder) -> int:
    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            total += sum(f.get_tensor(name).nbytes for name in f.keys())  # noqa: SIM118 (not a dict)
    return total


@pytest.mark.parametrize("family", FAMILIES)
def test_export_bytes_equal_the_bf16_and_block_fp8_folders(family, tmp_path):
    """The block-FP8 folder is written by the same stream function a sync sends (quantized_stream); the tiny
    widths (e.g. 96-wide expert MLPs) leave partial 128-blocks, whose scales count whole."""
    source = make_tiny_hf_model(family, tmp_path / "bf16", tokenizer=False, dtype=torch.bfloat16)
    shape = shape_from_config(json.loads((source / "config.json").read_text()))
    assert _folder_bytes(source) == shape.export_bytes()
    fp8 = write_quantized_copy(str(source), str(tmp_path / "fp8"))
    assert _folder_bytes(tmp_path / "fp8") == shape.export_bytes("fp8") < shape.export_bytes()
    assert fp8 == str(tmp_path / "fp8")


def test_export_bytes_of_qwen2_5_1_5b_equal_what_an_h100_sync_carried():
    """docs/figures/fp8_h100_lease14_2026-12-07.json: weight_sync/bytes_total of the bf16 and fp8 runs."""
    qwen2_5_1_5b = {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                    "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                    "tie_word_embeddings": True}
    shape = shape_from_config(qwen2_5_1_5b)
    assert (shape.export_bytes(), shape.export_bytes("fp8")) == (3_087_428_608, 1_777_552_768)


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
