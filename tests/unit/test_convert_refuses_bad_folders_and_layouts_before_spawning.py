"""`mrl convert` checks its arguments before it spawns a rank: a folder without config.json, a layout size below 1,
a layout the model's shape does not split into and an unknown dtype are `mrl:` lines with exit code 2, and no
process is started."""

import json

import psutil

from mrl.cli import main

MODEL = {"architectures": ["Qwen2ForCausalLM"], "num_attention_heads": 6, "num_key_value_heads": 2,
         "num_hidden_layers": 3, "vocab_size": 512}


def _convert(capsys, *argv: str) -> list[str]:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    assert main(["convert", *argv]) == 2
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [ln for ln in err.splitlines() if not ln.startswith("mrl: hid ")]


def test_missing_folders_and_bad_sizes_are_named(tmp_path, capsys):
    lines = _convert(capsys, "to-megatron", str(tmp_path / "nope"), str(tmp_path / "out"), "--tp", "0",
                     "--dtype", "fp8")
    assert lines == [f"mrl: hf='{tmp_path / 'nope'}': no config.json there: pass the run's HF model folder",
                     "mrl: --dtype='fp8': must be one of float32, bfloat16, float16", "mrl: --tp=0: must be >= 1"]
    lines = _convert(capsys, "to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    assert lines[0] == f"mrl: checkpoint='{tmp_path / 'ckpt'}': no such folder"
    assert lines[1].startswith("mrl: --hf-config=") and "with --hf-config" in lines[1]


def test_a_layout_the_model_cannot_split_into_is_named(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(MODEL))
    assert _convert(capsys, "to-megatron", str(tmp_path), str(tmp_path / "out"), "--tp", "4") == [
        "mrl: --tp=4: must divide the model's attention heads (6) and key-value heads (2), or be a "
        "multiple of the key-value heads"]
    assert _convert(capsys, "to-megatron", str(tmp_path), str(tmp_path / "out"), "--pp", "2") == [
        "mrl: --pp=2: PP × VPP = 2 model chunks must divide the model's 3 layers (or set "
        "num_layers_in_first/last_pipeline_stage for an uneven split)"]
    assert _convert(capsys, "to-megatron", str(tmp_path), str(tmp_path / "out"), "--pp", "2", "--first", "2",
                    "--last", "2") == [
        "mrl: --pp=2: with num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2, the other -1 "
        "of the model's 3 layers must split evenly over the 0 middle stage(s) (each stage's layers a multiple of "
        "VPP = 1)"]
    assert _convert(capsys, "to-megatron", str(tmp_path), str(tmp_path / "out"), "--ep", "2") == [
        "mrl: --ep=2: the model has no experts (dense): expert parallel needs an MoE model"]
    # 512 tokens padded to a multiple of 512 × 2 rows: rank 1 would hold rows 512-1023, all padding
    assert _convert(capsys, "to-megatron", str(tmp_path), str(tmp_path / "out"), "--tp", "2", "--vocab-divisor",
                    "512") == [
        "mrl: --tp=2: pads the model's vocabulary (512 tokens) to a multiple of 1024 rows "
        "(make_vocab_size_divisible_by × TP), so a rank holds only padding: use a smaller TP or divisor"]
    assert _convert(capsys, "to-megatron", str(tmp_path), str(tmp_path / "out"), "--vocab-divisor", "0") == [
        "mrl: --vocab-divisor=0: must be >= 1"]


def test_an_uneven_pipeline_split_is_accepted_and_recorded(tmp_path):
    """3 layers over PP 2: 1 + 2 with --first 1 (Megatron's num_layers_in_first_pipeline_stage)."""
    import argparse

    from mrl.tools.convert import add_arguments, check_steps, steps_from_args

    (tmp_path / "config.json").write_text(json.dumps(MODEL))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["to-megatron", str(tmp_path), str(tmp_path / "out"), "--pp", "2", "--first", "1"])
    steps = steps_from_args(args)
    check_steps(steps)
    assert steps[0].layout.stage_fields() == {"num_layers_in_first_pipeline_stage": 1}
