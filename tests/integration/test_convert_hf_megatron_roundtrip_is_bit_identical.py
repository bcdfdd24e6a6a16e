"""`mrl convert` round trips are bit-identical: HF → Megatron dist-checkpoint at TP=2 → HF (read back at TP=1, so the
checkpoint is layout-free), an MoE model through EP=2, and an RL checkpoint written by the engine (model + optimizer
+ LR schedule) → HF. A LoRA run's checkpoint (TP=2, adapters trained one step) converts to the merged HF model its
engine exported, and (`--peft`, read at TP=2) to a PEFT folder whose per-projection factors give the same merged
weights: W + (alpha / r)·B·A under PEFT's names of the HF weights. A 1001-token vocabulary (padded to 1002 rows at
TP=2) round trips TP=2 → 1 and 1 → 2, and 3 layers written on uneven stages (1 + 2) read back as 2 + 1. One world-2
launch runs every conversion."""

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file

from mrl.config.schema import LoRAConfig, MegatronConfig, OptimConfig
from mrl.engine.megatron.engine import MegatronEngine
from mrl.models.tiny import make_tiny_hf_model
from mrl.tools import convert
from mrl.tools.convert import Layout, ToHF, ToMegatron
from mrl.utils.distributed import launch

pytestmark = pytest.mark.integration


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _assert_identical(source, converted):
    want, got = _tensors(source), _tensors(converted)
    assert sorted(got) == sorted(want)
    different = [n for n in want if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])]
    assert not different, different
    assert json.loads((converted / "config.json").read_text())["architectures"] == \
        json.loads((source / "config.json").read_text())["architectures"]
    assert (converted / "tokenizer.json").is_file()


def _engine_checkpoint_then_convert(rank, world, hf, rl_ckpt, steps):
    """An RL run's checkpoint (the engine's own save, with optimizer state), then the conversions."""
    engine = MegatronEngine(hf, MegatronConfig(tensor_model_parallel_size=2), OptimConfig(lr=1e-3, weight_decay=0.0))
    engine.initialize()
    # The engine saves Adam's state only once it exists: one step on zero gradients creates it and, without weight
    # decay, moves no weight (the Adam update of a zero gradient is exactly zero).
    engine.optimizer_step()
    engine.save_checkpoint(rl_ckpt)
    merged = _lora_checkpoint(hf, rl_ckpt + "_lora")
    convert.run_steps(rank, world, steps)
    return merged


def _lora_checkpoint(hf, path):
    """A LoRA engine's checkpoint after one real step, and the merged weights its export sends."""
    from mrl.algo.aggregation import agg_loss
    from mrl.engine.megatron.packing import JaggedBatch

    def loss_fn(outputs, mb, normalizer):
        return agg_loss(-outputs["log_probs"], mb["response_mask"], "token-mean", normalizer), {}

    engine = MegatronEngine(hf, MegatronConfig(tensor_model_parallel_size=2), OptimConfig(lr=1e-2),
                            lora=LoRAConfig(enable=True, rank=4, alpha=8.0))
    engine.initialize()
    g = torch.Generator().manual_seed(0)
    seqs = [{"input_ids": torch.randint(0, 100, (9,), generator=g), "response_mask": torch.ones(9)} for _ in range(2)]
    engine.forward_backward(JaggedBatch.from_sequences(seqs), loss_fn)
    engine.optimizer_step()
    engine.save_checkpoint(path)
    return {name: t.clone() for name, t in engine.export_weights()}


def test_conversions_round_trip_bit_identical(tmp_path):
    dense = make_tiny_hf_model("qwen3", tmp_path / "qwen3", seed=3)
    moe = make_tiny_hf_model("qwen3_moe", tmp_path / "moe", seed=4, dtype=torch.bfloat16)
    odd = make_tiny_hf_model("qwen3", tmp_path / "odd", seed=5, vocab_size=1001)
    three = make_tiny_hf_model("qwen3", tmp_path / "three", seed=6, num_hidden_layers=3)
    steps = [
        ToMegatron(str(dense), str(tmp_path / "mcore_tp2"), Layout(tp=2)),
        ToHF(str(tmp_path / "mcore_tp2"), str(tmp_path / "back_tp1"), Layout(tp=1)),
        ToMegatron(str(moe), str(tmp_path / "moe_ep2"), Layout(ep=2)),
        ToHF(str(tmp_path / "moe_ep2"), str(tmp_path / "moe_back"), Layout(tp=2)),
        ToHF(str(tmp_path / "rl_ckpt"), str(tmp_path / "rl_hf"), Layout(tp=2), hf_config=str(dense)),
        ToHF(str(tmp_path / "rl_ckpt_lora"), str(tmp_path / "lora_hf"), Layout(tp=1), hf_config=str(dense)),
        ToHF(str(tmp_path / "rl_ckpt_lora"), str(tmp_path / "lora_hf2"), Layout(tp=2), hf_config=str(dense),
             peft=str(tmp_path / "lora_peft")),
        # a vocabulary TP=2 pads (1001 → 1002 rows) written at one TP and read at the other
        ToMegatron(str(odd), str(tmp_path / "odd_tp2"), Layout(tp=2)),
        ToHF(str(tmp_path / "odd_tp2"), str(tmp_path / "odd_back_tp1"), Layout(tp=1)),
        ToMegatron(str(odd), str(tmp_path / "odd_tp1"), Layout()),
        ToHF(str(tmp_path / "odd_tp1"), str(tmp_path / "odd_back_tp2"), Layout(tp=2)),
        # 3 layers on uneven stages, written as 1 + 2 and read as 2 + 1
        ToMegatron(str(three), str(tmp_path / "three_pp2"), Layout(pp=2, first=1)),
        ToHF(str(tmp_path / "three_pp2"), str(tmp_path / "three_back"), Layout(pp=2, last=1)),
    ]
    merged = launch(_engine_checkpoint_then_convert, 2, str(dense), str(tmp_path / "rl_ckpt"), steps,
                    timeout_s=300)[0]

    meta = convert.read_metadata(str(tmp_path / "mcore_tp2"))
    assert meta["layout"]["tp"] == 2 and meta["dtype"] == "float32"
    _assert_identical(dense, tmp_path / "back_tp1")
    assert convert.read_metadata(str(tmp_path / "moe_ep2"))["dtype"] == "bfloat16"
    _assert_identical(moe, tmp_path / "moe_back")
    _assert_identical(dense, tmp_path / "rl_hf")
    _assert_identical(odd, tmp_path / "odd_back_tp1")
    _assert_identical(odd, tmp_path / "odd_back_tp2")
    assert convert.read_metadata(str(tmp_path / "three_pp2"))["layout"]["first"] == 1
    _assert_identical(three, tmp_path / "three_back")
    lora_hf, base = _tensors(tmp_path / "lora_hf"), _tensors(dense)
    assert sorted(lora_hf) == sorted(merged) == sorted(base)
    for name, tensor in merged.items():
        torch.testing.assert_close(lora_hf[name], tensor, atol=1e-6, rtol=1e-6, msg=name)
    moved = [n for n in base if not torch.equal(lora_hf[n], base[n])]
    assert moved and all(n.endswith(".weight") and ("_proj" in n) for n in moved), moved  # only adapted layers
    _assert_peft_merges_to(tmp_path / "lora_peft", base, merged)


def _assert_peft_merges_to(folder, base, merged):
    from mrl.engine.megatron.lora_peft import peft_name

    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    factors = load_file(folder / "adapter_model.safetensors")
    adapted = [n for n in base if peft_name(n, "A") in factors]
    assert len(factors) == 2 * len(adapted) == 2 * 7 * sum(n.endswith("q_proj.weight") for n in base)
    for name in adapted:
        delta = factors[peft_name(name, "B")] @ factors[peft_name(name, "A")] * config["lora_alpha"] / config["r"]
        torch.testing.assert_close(base[name] + delta, merged[name], atol=1e-6, rtol=1e-6, msg=name)


def test_cli_layout_defaults_to_the_recorded_one_and_flags_win(tmp_path):
    (tmp_path / convert.METADATA).write_text(json.dumps({"layout": {"tp": 2, "pp": 2, "ep": 4}, "dtype": "bfloat16"}))
    parser = argparse.ArgumentParser()
    convert.add_arguments(parser)
    (step,) = convert.steps_from_args(parser.parse_args(["to-hf", str(tmp_path), "out", "--pp", "1"]))
    assert step.layout == Layout(tp=2, pp=1, ep=4)
    # PP stages of lcm(TP, EP × expert-TP) ranks: EP=4 with TP=2 (expert-TP = TP) needs 8 ranks per stage.
    assert step.layout.world_size() == 8
    assert Layout(tp=2, pp=2, ep=4, etp=1).world_size() == 8
    (first,) = convert.steps_from_args(parser.parse_args(["to-megatron", "hf", "out", "--tp", "2"]))
    assert first == ToMegatron("hf", "out", Layout(tp=2), None)
